//! `--criterion DIR`: criterion's medians imported into the JSON.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

/// One criterion benchmark's median estimate, ns (`null` where criterion has none).
#[derive(Clone, Debug, Serialize)]
pub(super) struct CriterionRow {
    pub(super) median_ns: Option<f64>,
    pub(super) ci_low_ns: Option<f64>,
    pub(super) ci_high_ns: Option<f64>,
}

/// Criterion's `new/estimates.json` medians under `dir`, keyed by benchmark id.
pub(super) fn import_criterion(dir: &Path) -> BTreeMap<String, CriterionRow> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            if p.file_name().is_some_and(|n| n == "new") {
                let est = p.join("estimates.json");
                let Ok(text) = std::fs::read_to_string(&est) else {
                    continue;
                };
                // Criterion's file, read leniently: a missing number is a `null`.
                let Ok(v) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                let Ok(rel) = d.strip_prefix(dir) else {
                    continue;
                };
                let m = &v["median"];
                let ci = &m["confidence_interval"];
                out.insert(
                    rel.to_string_lossy().into_owned(),
                    CriterionRow {
                        median_ns: m["point_estimate"].as_f64(),
                        ci_low_ns: ci["lower_bound"].as_f64(),
                        ci_high_ns: ci["upper_bound"].as_f64(),
                    },
                );
            } else if p.file_name().is_some_and(|n| n != "report" && n != "base") {
                stack.push(p);
            }
        }
    }
    out
}
