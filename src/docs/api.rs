//! The API page: every field of every kind in both served versions, from the same CRDs that
//! `capmox crds` writes to `crds/`.

use std::fmt::Write;

use super::DocsError;
use super::schema::{fields, table};

const INTRO: &str = "\
# API reference

Every field of capmox's kinds, in every served version, read from the CRD schemas
(`crds/`, which `capmox crds` prints). `v1alpha2` is the storage version; `v1alpha1` is served
for the Go provider's manifests and converted by capmox's webhook (see
[Migration from the Go provider](../migration.md)); the remediation kinds (see
[Reboot before replace](../topics/remediation.md)) are `v1alpha2` only. Validation lists what the API server checks
(OpenAPI bounds and patterns, CEL rules); capmox's validating webhook checks more (see
[Configuration](configuration.md#what-the-api-server-refuses)). Templates carry their object's
spec under `spec.template.spec`.
";

pub(super) fn render() -> Result<String, DocsError> {
    let mut out = String::from(INTRO);
    for crd in crate::api::crd::all()? {
        let names = &crd.spec.names;
        let short = names
            .short_names
            .as_ref()
            .map(|s| s.join(", "))
            .unwrap_or_default();
        // Writing to a String cannot fail.
        let _ = write!(
            out,
            "\n## {}\n\n`{}` ({}; plural `{}`, short names `{}`).\n",
            names.kind, crd.spec.group, crd.spec.scope, names.plural, short
        );
        for version in &crd.spec.versions {
            let role = if version.storage {
                "stored"
            } else if version.deprecated == Some(true) {
                "served, deprecated"
            } else {
                "served"
            };
            let _ = write!(out, "\n### {} {} ({role})\n\n", names.kind, version.name);
            let Some(schema) = crate::api::crd::schema_json_of(&crd, &version.name) else {
                out.push_str("No schema.\n");
                continue;
            };
            if let Some(description) = schema["description"].as_str() {
                let _ = writeln!(out, "{}\n", super::one_line(description));
            }
            let rows: Vec<_> = fields(&schema, "")
                .into_iter()
                .filter(|f| !["apiVersion", "kind", "metadata"].contains(&f.path.as_str()))
                .collect();
            out.push_str(&table(&rows));
        }
    }
    Ok(out)
}
