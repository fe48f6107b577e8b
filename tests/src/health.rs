//! A resource's health as GitOps tools read it: kstatus (Flux's `wait`, kpt, cli-utils) and
//! the Argo CD health check the docs ship (`docs/argocd-health.lua`), run in Lua 5.1 as Argo
//! CD's gopher-lua runs it (through `lupa` from PyPI).

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::Value;

/// kstatus' reading of a custom resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kstatus {
    /// Being deleted.
    Terminating,
    /// Not yet what its spec asks; the controller is on it.
    InProgress,
    /// The controller cannot make progress.
    Failed,
    /// What its spec asks.
    Current,
}

/// kstatus' generic rules for a resource it has no special case for (cli-utils
/// `pkg/kstatus/status`, `checkGenericProperties`): a deletion timestamp is Terminating; an
/// `observedGeneration` behind `metadata.generation` is InProgress; then `Reconciling=True` is
/// InProgress and `Stalled=True` is Failed; anything else is Current.
pub fn kstatus(obj: &Value) -> Kstatus {
    if !obj["metadata"]["deletionTimestamp"].is_null() {
        return Kstatus::Terminating;
    }
    let observed = &obj["status"]["observedGeneration"];
    if !observed.is_null() && observed != &obj["metadata"]["generation"] {
        return Kstatus::InProgress;
    }
    let holds = |type_: &str| {
        obj["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == type_ && c["status"] == "True")
    };
    if holds("Reconciling") {
        Kstatus::InProgress
    } else if holds("Stalled") {
        Kstatus::Failed
    } else {
        Kstatus::Current
    }
}

/// The health check's script, as users install it into `argocd-cm`.
pub const ARGOCD_HEALTH: &str = include_str!("../../docs/argocd-health.lua");

/// Argo CD's `(status, message)` for `obj`, from the shipped script run by Lua (`lupa`).
pub fn argocd(obj: &Value) -> (String, String) {
    // Argo CD hands the script the object as the global `obj` (JSON null is nil) and reads
    // the table it returns.
    const RUNNER: &str = r#"
import json, sys
from lupa import lua51
lua = lua51.LuaRuntime()
def table(v):
    if isinstance(v, dict):
        return lua.table_from({k: table(x) for k, x in v.items() if x is not None})
    if isinstance(v, list):
        return lua.table_from([table(x) for x in v])
    return v
given = json.loads(sys.stdin.read())
lua.globals().obj = table(given["obj"])
hs = lua.execute(given["script"])
print(json.dumps({"status": hs["status"], "message": hs["message"]}))
"#;
    let python = crate::python_with("lupa");
    let mut child = Command::new(python)
        .args(["-c", RUNNER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start python");
    let input = serde_json::json!({"obj": obj, "script": ARGOCD_HEALTH});
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the health check failed on {obj}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hs: Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        hs["status"].as_str().unwrap_or_default().to_owned(),
        hs["message"].as_str().unwrap_or_default().to_owned(),
    )
}

/// Asserts that kstatus and Argo CD read `obj` as `expected` and `argo_status`.
pub fn assert_health(obj: &impl serde::Serialize, expected: Kstatus, argo_status: &str) {
    let obj = serde_json::to_value(obj).unwrap();
    let name = &obj["metadata"]["name"];
    assert_eq!(kstatus(&obj), expected, "kstatus of {name}: {obj}");
    let (status, message) = argocd(&obj);
    assert_eq!(status, argo_status, "Argo CD health of {name}: {message}");
}
