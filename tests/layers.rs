//! host/ is in layers (docs/design.md, "Where things are"): each file imports only its
//! own layer's files and lower layers, and the import graph between files has no cycle.
//!
//! The scan reads every `crate::…` and `super::…` path in host/src's product code
//! (comments and `#[cfg(test)]` code left out: a test may use what it likes) and
//! resolves it to the file that defines the module named.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first. A file in a layer may import from its own and lower ones.
const LAYERS: &[&str] = &[
    "exit", "vmm", "drain", "control", "flight", "pipeline", "bench", "cli",
];

/// A file's module path: `host/src/drain/session.rs` → `["drain", "session"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().map(String::as_str) == Some("mod") {
        parts.pop();
    }
    parts
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read_dir") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Product code only: line comments dropped, a `#[cfg(test)] mod x;` line skipped (the
/// file it names is left out by [`test_only`]), and everything from any other
/// `#[cfg(test)]` item on (tests modules sit at the end of a file by this crate's
/// convention).
fn product_code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            match lines.next() {
                Some(next) if next.trim_end().ends_with(';') => continue,
                _ => break,
            }
        }
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// The `a::b::c` path segments following each occurrence of `prefix` (`crate::`, `super::`).
fn paths<'a>(code: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut v = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before_ok = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric();
        rest = &rest[i + prefix.len()..];
        if !before_ok {
            continue;
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        v.push(rest[..end].split("::").filter(|s| !s.is_empty()).collect());
    }
    v
}

/// The longest module prefix of `segs` that is a file of the crate.
fn resolve(modules: &BTreeSet<Vec<String>>, segs: &[&str]) -> Option<Vec<String>> {
    (1..=segs.len())
        .rev()
        .map(|n| segs[..n].iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .find(|m| modules.contains(m))
}

/// The modules declared `#[cfg(test)] mod x;` (test-only files, e.g. the models).
fn test_only(src: &Path, all: &[PathBuf]) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    for f in all {
        let me = module_of(src, f);
        let text = std::fs::read_to_string(f).expect("read");
        let mut lines = text.lines().map(str::trim);
        while let Some(line) = lines.next() {
            if line.starts_with("#[cfg(test)]") {
                if let Some(name) = lines
                    .next()
                    .and_then(|l| l.strip_suffix(';'))
                    .and_then(|l| l.rsplit(' ').next())
                {
                    let mut m = me.clone();
                    m.push(name.to_string());
                    out.insert(m);
                }
            }
        }
    }
    out
}

fn graph() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("host/src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let tests = test_only(&src, &all);
    all.retain(|f| !tests.iter().any(|t| module_of(&src, f).starts_with(t)));
    let modules: BTreeSet<Vec<String>> = all.iter().map(|f| module_of(&src, f)).collect();
    let mut g = BTreeMap::new();
    for f in &all {
        let me = module_of(&src, f);
        let code = product_code(&std::fs::read_to_string(f).expect("read"));
        let mut deps = BTreeSet::new();
        for segs in paths(&code, "crate::") {
            deps.extend(resolve(&modules, &segs));
        }
        // `super::x` in `a/b.rs` (module a::b) names a::x; in `a/mod.rs` (module a), crate::x.
        let parent: Vec<&str> = me
            .iter()
            .map(String::as_str)
            .take(me.len().saturating_sub(1))
            .collect();
        for segs in paths(&code, "super::") {
            let full: Vec<&str> = parent.iter().copied().chain(segs.iter().copied()).collect();
            deps.extend(resolve(&modules, &full));
        }
        deps.remove(&me);
        // A module's own children and its parent (`mod.rs` declaring them) are not imports.
        deps.retain(|d: &Vec<String>| !(d.starts_with(&me) || me.starts_with(d)));
        g.insert(me, deps);
    }
    g
}

fn layer(m: &[String]) -> Option<usize> {
    LAYERS
        .iter()
        .position(|l| m.first().map(String::as_str) == Some(*l))
}

#[test]
fn imports_go_down_only() {
    let mut bad = Vec::new();
    for (from, deps) in graph() {
        let Some(lf) = layer(&from) else { continue }; // lib.rs, main.rs: the root
        for to in deps {
            if let Some(lt) = layer(&to) {
                if lt > lf {
                    bad.push(format!(
                        "{} imports {} (a higher layer)",
                        from.join("::"),
                        to.join("::")
                    ));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "imports against the layers:\n{}",
        bad.join("\n")
    );
}

#[test]
fn no_import_cycle() {
    let g = graph();
    // Depth-first search with colours; a grey node reached again closes a cycle.
    fn visit(
        n: &Vec<String>,
        g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        colour: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<String>> {
        colour.insert(n.clone(), 1);
        stack.push(n.clone());
        for d in g.get(n).into_iter().flatten() {
            match colour.get(d).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == d).unwrap_or(0);
                    let mut c: Vec<String> = stack[at..].iter().map(|m| m.join("::")).collect();
                    c.push(d.join("::"));
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(d, g, colour, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        colour.insert(n.clone(), 2);
        None
    }
    let mut colour = BTreeMap::new();
    for n in g.keys() {
        if colour.get(n).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, &g, &mut colour, &mut Vec::new()) {
                panic!("import cycle: {}", c.join(" -> "));
            }
        }
    }
}

/// The scan itself: it finds an upward import and a cycle when there is one.
#[test]
fn the_scan_sees_imports() {
    let g = graph();
    let run = g
        .get(&vec!["pipeline".to_string(), "run".to_string()])
        .expect("pipeline::run scanned");
    assert!(
        run.contains(&vec!["drain".to_string(), "session".to_string()]),
        "{run:?}"
    );
    assert!(
        product_code("use crate::cli::X;\n#[cfg(test)]\nmod tests { use crate::x; }")
            .contains("crate::cli")
    );
    assert!(!product_code("// crate::cli\n#[cfg(test)]\nuse crate::cli;").contains("crate::cli"));
    assert_eq!(
        paths("use crate::drain::session::{A, B};", "crate::"),
        vec![vec!["drain", "session"]]
    );
}
