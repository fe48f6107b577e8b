//! Human tables and `-o json`.

use std::fmt::Write as _;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    #[default]
    Table,
    Json,
}

/// Prints `value` as pretty JSON, or as the human table `table` makes of it.
pub fn print<T: serde::Serialize + ?Sized>(
    format: Format,
    value: &T,
    table: impl FnOnce(&T) -> String,
) -> anyhow::Result<()> {
    match format {
        Format::Json => println!("{}", serde_json::to_string_pretty(value)?),
        Format::Table => print!("{}", table(value)),
    }
    Ok(())
}

/// A left-aligned text table with a header row.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: Vec<&str>| {
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let _ = write!(text, "{:<width$}  ", cell, width = widths[i]);
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut out, headers.to_vec());
    for row in rows {
        line(&mut out, row.iter().map(String::as_str).collect());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_columns() {
        let text = table(&["a", "long header"], &[vec!["value".into(), "x".into()]]);
        assert_eq!(text, "a      long header\nvalue  x\n");
    }
}
