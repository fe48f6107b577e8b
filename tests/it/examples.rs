//! `examples/keda-scaledobject.yaml` as KEDA and the operator will read it: the KEDA objects
//! against KEDA's published CRD schema (its npm models, checked by TypeScript for unknown or
//! mistyped fields and by their validators for formats), and the wiring against what this
//! repository serves (the group's scale subresource, the KEDA endpoint's path, field and
//! authorization, the chart's Service and CA Secret). `examples/producer-wake.yaml` likewise:
//! the chart's role for producers, the token's audience, the Service and CA, the variables the
//! producers' client reads.

use std::path::Path;
use std::process::Command;

use cosmosq_crds::{QueueConsumerGroup, ScalingMode};
use cosmosq_operator::context::GroupFigures;
use kube::CustomResourceExt;
use serde_json::{json, Value};

const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/keda-scaledobject.yaml"
);
const PRODUCER_EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/producer-wake.yaml"
);

fn documents() -> Vec<Value> {
    documents_of(EXAMPLE)
}

fn documents_of(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(path).expect("the example");
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the example"))
}

/// Whether `role` lets its subjects `verb` `resource` (of `group`) named `name`.
fn allows(role: &Value, group: &str, resource: &str, verb: &str, name: &str) -> bool {
    let has = |rule: &Value, key: &str, value: &str| {
        rule[key]
            .as_array()
            .is_some_and(|v| v.iter().any(|x| x == value || x == "*"))
    };
    role["rules"].as_array().into_iter().flatten().any(|rule| {
        has(rule, "apiGroups", group)
            && has(rule, "resources", resource)
            && has(rule, "verbs", verb)
            && (rule.get("resourceNames").is_none() || has(rule, "resourceNames", name))
    })
}

/// The Role a RoleBinding for `subject` (kind, name, namespace) grants, in `docs`.
fn roles_of<'a>(docs: &'a [Value], subject: (&str, &str, &str)) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"] == "RoleBinding")
        .filter(|b| {
            b["subjects"].as_array().into_iter().flatten().any(|s| {
                s["kind"] == subject.0 && s["name"] == subject.1 && s["namespace"] == subject.2
            })
        })
        .map(|b| find(docs, "Role", b["roleRef"]["name"].as_str().unwrap()))
        .collect()
}

#[test]
fn the_keda_example_scales_the_group_through_what_the_operator_serves() {
    let docs = documents();
    let so = docs
        .iter()
        .find(|d| d["kind"] == "ScaledObject")
        .expect("a ScaledObject");
    let namespace = so["metadata"]["namespace"].as_str().unwrap();

    // It targets the group itself, through the scale subresource of an External-mode group.
    let target = &so["spec"]["scaleTargetRef"];
    assert_eq!(
        (&target["apiVersion"], &target["kind"]),
        (&json!("cosmosq.io/v1alpha1"), &json!("QueueConsumerGroup"))
    );
    let group_doc = find(
        &docs,
        "QueueConsumerGroup",
        target["name"].as_str().unwrap(),
    );
    assert_eq!(group_doc["metadata"]["namespace"], namespace);
    let group: QueueConsumerGroup =
        serde_json::from_value(group_doc.clone()).expect("a valid QueueConsumerGroup");
    assert_eq!(group.spec.scaling.mode, ScalingMode::External);
    let (control, _) = cosmosq_operator::spec::control(&group);
    assert!(
        matches!(control, cosmosq_operator::spec::Control::External(Some(_))),
        "{control:?}"
    );
    cosmosq_operator::spec::group(&group).expect("settings the operator accepts");
    let crd = serde_json::to_value(QueueConsumerGroup::crd()).unwrap();
    let scale = &crd["spec"]["versions"][0]["subresources"]["scale"];
    assert_eq!(scale["specReplicasPath"], ".spec.replicas", "{scale}");
    assert_eq!(scale["labelSelectorPath"], ".status.selector", "{scale}");

    // Its trigger reads the group's figures at the operator's KEDA endpoint.
    let [trigger] = so["spec"]["triggers"].as_array().unwrap().as_slice() else {
        panic!("one trigger")
    };
    assert_eq!(trigger["type"], "metrics-api");
    let meta = &trigger["metadata"];
    assert_eq!(meta["authMode"], "bearer");
    let url = meta["url"].as_str().unwrap();
    let (_, path) = url
        .strip_prefix("https://")
        .and_then(|rest| rest.split_once('/'))
        .expect("an https URL");
    assert_eq!(
        format!("/{path}"),
        format!(
            "/keda/namespaces/{namespace}/queueconsumergroups/{}",
            group.metadata.name.as_deref().unwrap()
        )
    );
    let served = serde_json::to_value(GroupFigures {
        namespace: namespace.into(),
        queue: group.spec.queue_ref.name.clone(),
        group: "invoicing".into(),
        backlog: Some(7),
        lag: Some(3),
        oldest_message_age_seconds: Some(1),
        desired_replicas: 1,
        error: None,
        measured_at: 0,
    })
    .unwrap();
    let location = meta["valueLocation"].as_str().unwrap();
    assert_eq!(served[location], 7, "{location} is the backlog in {served}");
    for number in ["targetValue", "activationTargetValue"] {
        assert!(
            meta[number].as_str().unwrap().parse::<f64>().is_ok(),
            "{number} is a number in a string, as KEDA reads trigger metadata"
        );
    }

    // Its authentication: a token of a ServiceAccount that may `get` the group (what the
    // endpoint's SubjectAccessReview asks), minted by KEDA, and the CA to verify the operator.
    let auth_name = trigger["authenticationRef"]["name"].as_str().unwrap();
    let auth = find(&docs, "TriggerAuthentication", auth_name);
    assert_eq!(auth["metadata"]["namespace"], namespace);
    let token = auth["spec"]["boundServiceAccountToken"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["parameter"] == "token")
        .expect("a bearer token parameter");
    let account = token["serviceAccountName"].as_str().unwrap();
    find(&docs, "ServiceAccount", account);
    let group_name = group.metadata.name.as_deref().unwrap();
    assert!(
        roles_of(&docs, ("ServiceAccount", account, namespace))
            .iter()
            .any(|r| allows(r, "cosmosq.io", "queueconsumergroups", "get", group_name)),
        "{account} may get the group"
    );
    assert!(
        roles_of(&docs, ("ServiceAccount", "keda-operator", "keda"))
            .iter()
            .any(|r| allows(r, "", "serviceaccounts/token", "create", account)),
        "KEDA may mint {account}'s tokens"
    );
    let ca = auth["spec"]["secretTargetRef"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["parameter"] == "ca")
        .expect("the operator's CA");
    assert_eq!(ca["key"], "ca.crt");

    // The host and the CA Secret the comments name are the chart's (release "cosmosq" in
    // namespace "cosmosq", kedaEndpoint on).
    let chart = rendered_chart();
    chart_service(&chart, url);
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let named = ca_secret_read(&chart);
    assert!(text.contains(&named), "the example says {named:?}");
}

/// The operator's argument `flag` in the chart's Deployment.
fn operator_arg<'a>(chart: &'a [Value], flag: &str) -> &'a str {
    let deployment = chart
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("the operator's Deployment");
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|a| a.as_str()?.strip_prefix(flag))
        .unwrap_or_else(|| panic!("the chart passes {flag}"))
}

/// How an example's comment reads the CA the operator issues: from the Secret its Deployment
/// names, in its own namespace.
fn ca_secret_read(chart: &[Value]) -> String {
    let secret = operator_arg(chart, "--serving-cert-secret=");
    let namespace = chart
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .and_then(|d| d["metadata"]["namespace"].as_str())
        .expect("the operator's namespace");
    format!("kubectl -n {namespace} get secret {secret}")
}

/// The Service an `https://<service>.<namespace>.svc` URL names, in the chart, on port 443.
fn chart_service<'a>(chart: &'a [Value], url: &str) -> &'a Value {
    let host = url
        .strip_prefix("https://")
        .map(|rest| rest.split('/').next().unwrap_or(rest))
        .expect("an https URL");
    let (service, service_ns) = host
        .strip_suffix(".svc")
        .and_then(|h| h.split_once('.'))
        .expect("<service>.<namespace>.svc, no port");
    let service = find(chart, "Service", service);
    assert_eq!(service["metadata"]["namespace"], service_ns);
    assert!(
        service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == 443),
        "the URL has no port: 443 {service}"
    );
    service
}

#[test]
fn the_producer_example_wakes_through_what_the_chart_and_operator_serve() {
    let docs = documents_of(PRODUCER_EXAMPLE);
    let chart = rendered_chart();
    let deployment = find(&docs, "Deployment", "invoice-producer");
    let namespace = deployment["metadata"]["namespace"].as_str().unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    let account = pod["serviceAccountName"].as_str().unwrap();
    find(&docs, "ServiceAccount", account);

    // Its account is bound to the chart's role for producers, which grants the wake.
    let binding = docs
        .iter()
        .find(|d| {
            d["kind"] == "RoleBinding"
                && d["subjects"].as_array().into_iter().flatten().any(|s| {
                    s["kind"] == "ServiceAccount"
                        && s["name"] == account
                        && s["namespace"] == namespace
                })
        })
        .expect("a RoleBinding of the producer's account");
    assert_eq!(binding["metadata"]["namespace"], namespace);
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    let role = find(
        &chart,
        "ClusterRole",
        binding["roleRef"]["name"].as_str().unwrap(),
    );
    assert!(
        allows(
            role,
            "cosmosq.io",
            "cosmosqueues/wake",
            "create",
            "invoices"
        ),
        "{role}"
    );
    assert_eq!(
        role["rules"].as_array().unwrap().len(),
        1,
        "the role grants the wake and nothing else: {role}"
    );

    // The variables are the ones the producers' client reads, and point at what is mounted.
    let [container] = pod["containers"].as_array().unwrap().as_slice() else {
        panic!("one container")
    };
    let env = |name: &str| {
        container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{name} is set"))
            .to_owned()
    };
    let read: Vec<String> = <cosmosq_program::wake::OperatorArgs as clap::Args>::augment_args(
        clap::Command::new("producer"),
    )
    .get_arguments()
    .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
    .collect();
    for variable in container["env"].as_array().unwrap() {
        let name = variable["name"].as_str().unwrap();
        assert!(read.iter().any(|r| r == name), "{name} is one of {read:?}");
    }
    let mounted = |file: &str| -> (String, &Value) {
        let mount = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| file.starts_with(&format!("{}/", m["mountPath"].as_str().unwrap())))
            .unwrap_or_else(|| panic!("{file} is in a mounted volume"));
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .expect("the mount's volume");
        let inside = file[mount["mountPath"].as_str().unwrap().len() + 1..].to_owned();
        (inside, volume)
    };
    let (path, volume) = mounted(&env("COSMOSQ_OPERATOR_TOKEN_FILE"));
    assert_eq!(
        env("COSMOSQ_OPERATOR_TOKEN_FILE"),
        cosmosq_program::wake::DEFAULT_TOKEN_FILE,
        "the default, so `cosmosq enqueue --wake` finds it unset too"
    );
    let token = volume["projected"]["sources"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|s| s.get("serviceAccountToken"))
        .expect("a projected ServiceAccount token");
    assert_eq!(token["path"], path);
    assert_eq!(
        token["audience"],
        operator_arg(&chart, "--token-audience="),
        "minted for the audience the operator asks for"
    );
    let (key, volume) = mounted(&env("COSMOSQ_OPERATOR_CA_FILE"));
    assert_eq!(key, "ca.crt");
    let config_map = volume["configMap"]["name"].as_str().unwrap();
    let text = std::fs::read_to_string(PRODUCER_EXAMPLE).unwrap();
    let made = format!("kubectl -n {namespace} create configmap {config_map} --from-file=ca.crt");
    assert!(text.contains(&made), "the example says {made:?}");
    let named = ca_secret_read(&chart);
    assert!(text.contains(&named), "the example says {named:?}");

    // The URL is the chart's Service, and the client takes it.
    let url = env("COSMOSQ_OPERATOR_URL");
    chart_service(&chart, &url);
    assert_eq!(
        operator_arg(&chart, "--wake-endpoint="),
        "true",
        "on by default"
    );
    cosmosq_program::wake::Waker::new(&url, None, path.into()).expect("a URL the client takes");
    let wake =
        format!("POST $COSMOSQ_OPERATOR_URL/v1/namespaces/{namespace}/cosmosqueues/invoices/wake");
    assert!(text.contains(&wake), "the example says {wake:?}");
}

/// The chart rendered as the example assumes.
fn rendered_chart() -> Vec<Value> {
    cosmosq_tests::helm_template(
        "cosmosq",
        "cosmosq",
        &["--set", "kedaEndpoint.enabled=true"],
    )
    .into_iter()
    .filter(Value::is_object)
    .collect()
}

/// TypeScript over KEDA's models: an unknown or mistyped field is an error.
fn typecheck(models: &Path, name: &str, scaled_object: &Value, auth: &Value) -> (bool, String) {
    let dir = models.join("checks");
    std::fs::create_dir_all(&dir).unwrap();
    let source = format!(
        "import type {{ IScaledObject }} from \"@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject\";\n\
         import type {{ ITriggerAuthentication }} from \"@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication\";\n\
         export const scaledObject: IScaledObject = {scaled_object};\n\
         export const triggerAuthentication: ITriggerAuthentication = {auth};\n"
    );
    let file = dir.join(format!("{name}.ts"));
    std::fs::write(&file, source).unwrap();
    let output = Command::new("node")
        .arg(models.join("node_modules/typescript/bin/tsc"))
        .args([
            "--noEmit",
            "--strict",
            "--skipLibCheck",
            "--module",
            "nodenext",
            "--moduleResolution",
            "nodenext",
            "--target",
            "es2022",
        ])
        .arg(&file)
        .output()
        .expect("node runs tsc");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[test]
fn the_keda_example_matches_kedas_published_crd_schema() {
    let models = cosmosq_tests::keda_models();
    let docs = documents();
    let so = docs
        .iter()
        .find(|d| d["kind"] == "ScaledObject")
        .unwrap()
        .clone();
    let auth = docs
        .iter()
        .find(|d| d["kind"] == "TriggerAuthentication")
        .unwrap()
        .clone();

    let (ok, errors) = typecheck(&models, "example", &so, &auth);
    assert!(ok, "the example does not fit KEDA's schema:\n{errors}");

    // The check can fail: a misspelt field, a mistyped one, each refused.
    let mut misspelt = so.clone();
    misspelt["spec"]["minReplicaCont"] = json!(0);
    let mut mistyped = auth.clone();
    mistyped["spec"]["boundServiceAccountToken"][0]["serviceAccountName"] = json!(7);
    for (name, so, auth, error) in [
        (
            "misspelt",
            &misspelt,
            &auth,
            "minReplicaCont\"' does not exist",
        ),
        (
            "mistyped",
            &so,
            &mistyped,
            "'number' is not assignable to type 'string'",
        ),
    ] {
        let (ok, errors) = typecheck(&models, name, so, auth);
        assert!(!ok && errors.contains(error), "{name}: {errors}");
    }

    // And the models' own validators (formats, integer ranges) accept both objects.
    let script = format!(
        "import {{ ScaledObject }} from \"@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject\";\n\
         import {{ TriggerAuthentication }} from \"@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication\";\n\
         new ScaledObject({so}).validate();\n\
         new TriggerAuthentication({auth}).validate();\n\
         console.log(\"valid\");\n"
    );
    let file = models.join("checks/validate.mjs");
    std::fs::write(&file, script).unwrap();
    let output = Command::new("node").arg(&file).output().expect("node");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
