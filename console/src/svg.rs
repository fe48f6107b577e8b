//! Charts as inline SVG, drawn on the server: no chart library, nothing to download, and a
//! page that shows its figures before any script runs. Pure functions of the points.

use maud::{html, Markup};

/// A path through `points` (x = epoch ms, y = value) scaled into `width`×`height`, the x axis
/// spanning `from_ms..=to_ms` and the y axis `y.0..=y.1`. `None` with fewer than two points.
pub fn path(
    points: &[(i64, f64)],
    from_ms: i64,
    to_ms: i64,
    y: (f64, f64),
    width: f64,
    height: f64,
) -> Option<String> {
    if points.len() < 2 || to_ms <= from_ms {
        return None;
    }
    let (low, high) = if y.1 > y.0 { y } else { (y.0, y.0 + 1.0) };
    let mut d = String::new();
    for (i, (at, value)) in points.iter().enumerate() {
        let x = (at - from_ms) as f64 / (to_ms - from_ms) as f64 * width;
        let y = height - ((value - low) / (high - low)).clamp(0.0, 1.0) * height;
        d.push_str(&format!(
            "{}{:.1} {:.1}",
            if i == 0 { "M" } else { " L" },
            x.clamp(0.0, width),
            y
        ));
    }
    Some(d)
}

/// At most `buckets` points: the span cut into equal slices, each keeping its highest value
/// (a spike must not vanish from a backlog line), at its slice's last time. A chart has no use
/// for more points than pixels; an hour of samples per group would make the overview of
/// 500 groups megabytes.
pub fn thin(points: &[(i64, f64)], from_ms: i64, to_ms: i64, buckets: usize) -> Vec<(i64, f64)> {
    if points.len() <= buckets || to_ms <= from_ms || buckets == 0 {
        return points.to_vec();
    }
    let slice = |at: i64| -> usize {
        let at = at.clamp(from_ms, to_ms);
        (((at - from_ms) as f64 / (to_ms - from_ms) as f64 * buckets as f64) as usize)
            .min(buckets - 1)
    };
    let mut out: Vec<(usize, (i64, f64))> = Vec::with_capacity(buckets);
    for &(at, value) in points {
        let b = slice(at);
        match out.last_mut() {
            Some((last, kept)) if *last == b => *kept = (at, kept.1.max(value)),
            _ => out.push((b, (at, value))),
        }
    }
    out.into_iter().map(|(_, p)| p).collect()
}

/// A number for an axis label: 950, 1.2k, 3.4M.
pub fn short(value: f64) -> String {
    let abs = value.abs();
    if abs >= 1e6 {
        format!("{:.1}M", value / 1e6)
    } else if abs >= 1e3 {
        format!("{:.1}k", value / 1e3)
    } else if abs >= 10.0 || value == value.trunc() {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// The scale of a chart: from zero (or the lowest value, when below) to the highest, with
/// room above and below.
fn y_range(points: &[(i64, f64)]) -> (f64, f64) {
    let max = points.iter().map(|p| p.1).fold(0.0, f64::max);
    let min = points.iter().map(|p| p.1).fold(0.0, f64::min);
    match (min < 0.0, max > 0.0) {
        (false, false) => (0.0, 1.0),
        _ => (min * 1.1, max * 1.1),
    }
}

/// A span of time for an axis: "45 s", "12 min", "1 h".
pub fn span(ms: i64) -> String {
    match ms / 1000 {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s => format!("{} h", s / 3600),
    }
}

/// A small line of the recent past, for a table cell.
pub fn sparkline(points: &[(i64, f64)], from_ms: i64, to_ms: i64) -> Markup {
    let (w, h) = (120.0, 24.0);
    let points = &thin(points, from_ms, to_ms, w as usize);
    let d = path(points, from_ms, to_ms, y_range(points), w, h);
    html! {
        svg.spark viewBox=(format!("0 0 {w} {h}")) width=(w) height=(h) role="img"
            aria-label=(format!("backlog over the last {}", span(to_ms - from_ms))) {
            @if let Some(d) = d { path d=(d) {} } @else { line x1="0" y1=(h - 1.0) x2=(w) y2=(h - 1.0) {} }
        }
    }
}

/// A chart with a title, the latest value, the scale and the time span.
pub fn chart(title: &str, unit: &str, points: &[(i64, f64)], from_ms: i64, to_ms: i64) -> Markup {
    let (w, h) = (480.0, 120.0);
    let points = &thin(points, from_ms, to_ms, w as usize);
    let (low, high) = y_range(points);
    // The labels say the values drawn, not the scale's padding around them.
    let highest = points.iter().map(|p| p.1).fold(0.0, f64::max);
    let lowest = points.iter().map(|p| p.1).fold(0.0, f64::min);
    let d = path(points, from_ms, to_ms, (low, high), w, h);
    let latest = points.last().map(|p| short(p.1));
    let over = span(to_ms - from_ms);
    // Where zero is, when the scale goes below it.
    let zero = h * high / (high - low);
    html! {
        figure.chart {
            figcaption {
                span.title { (title) }
                span.latest { @if let Some(v) = latest { (v) " " (unit) } @else { "no data yet" } }
            }
            svg viewBox=(format!("0 0 {w} {h}")) preserveAspectRatio="none" role="img"
                aria-label=(format!("{title} over the last {over}")) {
                line.grid x1="0" y1="0" x2=(w) y2="0" {}
                line.grid x1="0" y1=(h / 2.0) x2=(w) y2=(h / 2.0) {}
                line.axis x1="0" y1=(zero) x2=(w) y2=(zero) {}
                @if let Some(d) = &d { path d=(d) {} }
            }
            div.scale {
                span { "−" (over) }
                span { @if low < 0.0 { "min " (short(lowest)) ", " } "max " (short(highest)) }
                span { "now" }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_scaled_into_the_box() {
        let d = path(
            &[(0, 0.0), (50, 5.0), (100, 10.0)],
            0,
            100,
            (0.0, 10.0),
            200.0,
            100.0,
        )
        .unwrap();
        assert_eq!(d, "M0.0 100.0 L100.0 50.0 L200.0 0.0");
        // Values above the scale are drawn at the top, points before the span at the left.
        let d = path(
            &[(-50, 20.0), (100, 0.0)],
            0,
            100,
            (0.0, 10.0),
            200.0,
            100.0,
        )
        .unwrap();
        assert_eq!(d, "M0.0 0.0 L200.0 100.0");
        // A scale below zero: zero is in the middle of -5..5.
        let d = path(&[(0, -5.0), (100, 0.0)], 0, 100, (-5.0, 5.0), 200.0, 100.0).unwrap();
        assert_eq!(d, "M0.0 100.0 L200.0 50.0");
    }

    #[test]
    fn too_little_to_draw_is_no_path() {
        assert_eq!(path(&[], 0, 100, (0.0, 1.0), 10.0, 10.0), None);
        assert_eq!(path(&[(5, 1.0)], 0, 100, (0.0, 1.0), 10.0, 10.0), None);
        assert_eq!(
            path(&[(5, 1.0), (6, 1.0)], 100, 100, (0.0, 1.0), 10.0, 10.0),
            None
        );
        // A flat zero line still draws (the scale is 0..1, not 0..0).
        assert_eq!(y_range(&[(0, 0.0), (10, 0.0)]), (0.0, 1.0));
        assert!(path(&[(0, 0.0), (10, 0.0)], 0, 10, (0.0, 0.0), 10.0, 10.0).is_some());
    }

    #[test]
    fn thinning_keeps_a_point_per_slice_and_every_spike() {
        let points: Vec<(i64, f64)> = (0..100)
            .map(|i| (i, if i == 37 { 50.0 } else { 1.0 }))
            .collect();
        let thin10 = thin(&points, 0, 100, 10);
        assert_eq!(thin10.len(), 10);
        assert_eq!(
            thin10[3],
            (39, 50.0),
            "the spike at 37 kept, at its slice's last time"
        );
        assert!(thin10.iter().enumerate().all(|(i, p)| i == 3 || p.1 == 1.0));
        assert_eq!(
            thin(&points[..5], 0, 100, 10),
            points[..5].to_vec(),
            "few points stay as they are"
        );
    }

    #[test]
    fn spans_read_in_their_unit() {
        assert_eq!(span(45_000), "45 s");
        assert_eq!(span(720_000), "12 min");
        assert_eq!(span(3_600_000), "60 min");
        assert_eq!(span(4 * 3_600_000), "4 h");
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(short(950.0), "950");
        assert_eq!(short(1234.0), "1.2k");
        assert_eq!(short(3_400_000.0), "3.4M");
        assert_eq!(short(2.5), "2.5");
        assert_eq!(short(3.0), "3");
    }

    #[test]
    fn a_chart_says_its_title_latest_value_and_span() {
        let html = chart("Backlog", "msgs", &[(0, 1.0), (60_000, 2.0)], 0, 3_600_000).into_string();
        assert!(html.contains("Backlog"), "{html}");
        assert!(html.contains("2 msgs"), "{html}");
        assert!(
            html.contains("max 2<"),
            "the highest value, not the scale: {html}"
        );
        assert!(html.contains("−60 min"), "{html}");
        assert!(html.contains("<path d=\"M"), "{html}");
        let empty = chart("Backlog", "msgs", &[], 0, 3_600_000).into_string();
        assert!(
            empty.contains("no data yet") && !empty.contains("<path"),
            "{empty}"
        );
    }
}
