//! Import facts of the workspace (docs/design.md, "Where things are"):
//! - host/ is in layers: each file imports only its own layer's files and lower layers;
//! - in every crate (crates/*, host), the import graph between files has no cycle;
//! - the reader crate does not depend on the output crate, nor on zstd or prost (an
//!   embedder that only reads rings builds neither).
//! - no product file of any crate is over 1 000 lines (a `tests.rs`, only a test module,
//!   is not product code);
//! - clap appears only at the top: under host/src/cli and in the options files
//!   ([`CLAP_FILES`]); every other file of every crate takes typed plans.
//!
//! The scan reads every `crate::…` and `super::…` path in a crate's product code
//! (comments and `#[cfg(test)]` code left out: a test may use what it likes), use trees
//! (`crate::{a::X, b::Y}`) expanded, and resolves it to the file that defines the item:
//! a name a module imports or re-exports (`pub use sinks::{JsonSink, …}` in lib.rs,
//! `use x::Y` in a `mod.rs`) leads on to where it comes from. A module and the modules
//! it declares are one unit: imports between a file and its ancestors are not edges.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;
type Graph = BTreeMap<Module, BTreeSet<Module>>;

/// The layers, lowest first. A file in a layer may import from its own and lower ones.
const LAYERS: &[&str] = &[
    "exit", "vmm", "drain", "control", "flight", "pipeline", "bench", "cli",
];

/// A file's module path: `host/src/drain/session.rs` → `["drain", "session"]`; the
/// crate root (`lib.rs`, `main.rs`) is `[]`.
fn module_of(src: &Path, file: &Path) -> Module {
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
    if parts == ["lib"] || parts == ["main"] {
        parts.clear();
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

/// A line without its `//` comment.
fn code_of(line: &str) -> &str {
    match line.find("//") {
        Some(i) => &line[..i],
        None => line,
    }
}

/// Product code only: line comments dropped, and the item after each `#[cfg(test)]`
/// skipped (a `mod x;` line — the file it names is left out by [`test_only`] —, a field,
/// a function or a whole tests module: up to its `;`, `,` or closing brace).
fn product_code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            let mut depth = 0i64;
            let mut opened = false;
            for next in lines.by_ref() {
                // Brace characters as char literals do not open or close anything.
                let code = code_of(next).replace("'{'", "").replace("'}'", "");
                for c in code.chars() {
                    match c {
                        '{' => {
                            depth += 1;
                            opened = true;
                        }
                        '}' => depth -= 1,
                        _ => {}
                    }
                }
                let end = code.trim_end();
                if opened && depth <= 0 || !opened && (end.ends_with(';') || end.ends_with(',')) {
                    break;
                }
            }
            continue;
        }
        out.push_str(code_of(line));
        out.push('\n');
    }
    out
}

/// One path of a use tree and the name it is bound to (`as` or its last segment).
type Named = (Vec<String>, Option<String>);

fn skip_ws(b: &[u8], i: &mut usize) {
    while b.get(*i).is_some_and(|c| c.is_ascii_whitespace()) {
        *i += 1;
    }
}

fn ident(s: &str, i: &mut usize) -> String {
    let start = *i;
    while s
        .as_bytes()
        .get(*i)
        .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
    {
        *i += 1;
    }
    s[start..*i].to_string()
}

/// Parses the use tree at `s[*i..]` (`a::b`, `a::{b, c::{d, e}}`, `a::*`, `a as b`,
/// `{self, x}`) into `out`, each path after `prefix`. A glob names its prefix.
fn tree(s: &str, i: &mut usize, prefix: &mut Vec<String>, out: &mut Vec<Named>, depth: u32) {
    let b = s.as_bytes();
    let base = prefix.len();
    loop {
        if b.get(*i) == Some(&b'{') && depth < 8 {
            *i += 1;
            loop {
                skip_ws(b, i);
                if b.get(*i) == Some(&b'}') {
                    *i += 1;
                    break;
                }
                tree(s, i, prefix, out, depth + 1);
                skip_ws(b, i);
                match b.get(*i) {
                    Some(b',') => *i += 1,
                    Some(b'}') => {
                        *i += 1;
                        break;
                    }
                    _ => break, // not a use tree after all
                }
            }
            break;
        }
        let seg = ident(s, i);
        if seg.is_empty() {
            if b.get(*i) == Some(&b'*') {
                *i += 1;
            }
            out.push((prefix.clone(), None));
            break;
        }
        if seg != "self" {
            prefix.push(seg);
        }
        if b[*i..].starts_with(b"::") {
            *i += 2;
            continue;
        }
        let mut j = *i;
        skip_ws(b, &mut j);
        let alias = if b[j..].starts_with(b"as ") {
            j += 3;
            skip_ws(b, &mut j);
            *i = j;
            Some(ident(s, i))
        } else {
            None
        };
        out.push((prefix.clone(), alias));
        break;
    }
    prefix.truncate(base);
}

/// The paths following each occurrence of `prefix` (`crate::`, `super::`), use trees
/// expanded: `crate::a::{b::C, D}` → `a::b::C`, `a::D`.
fn paths(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut v = Vec::new();
    let mut at = 0;
    while let Some(k) = code[at..].find(prefix) {
        let i = at + k;
        at = i + prefix.len();
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let mut out = Vec::new();
        let mut j = at;
        tree(code, &mut j, &mut Vec::new(), &mut out, 0);
        v.extend(out.into_iter().map(|(p, _)| p));
    }
    v
}

/// The names a file's `use` items bind (public or not: a module's children see both),
/// each with the absolute path it stands for; paths into other crates are left out.
fn bindings(me: &[String], modules: &BTreeSet<Module>, code: &str) -> Vec<(String, Vec<String>)> {
    let mut v = Vec::new();
    for line in code.split(';') {
        let t = line.trim_start();
        let t = t
            .strip_prefix("pub ")
            .or_else(|| t.strip_prefix("pub(crate) "))
            .or_else(|| t.strip_prefix("pub(super) "))
            .unwrap_or(t);
        let Some(rest) = t.strip_prefix("use ") else {
            continue;
        };
        let mut out = Vec::new();
        tree(rest, &mut 0, &mut Vec::new(), &mut out, 0);
        for (p, alias) in out {
            let Some(first) = p.first() else { continue };
            let abs: Vec<String> = match first.as_str() {
                "crate" => p[1..].to_vec(),
                "super" => me[..me.len().saturating_sub(1)]
                    .iter()
                    .chain(&p[1..])
                    .cloned()
                    .collect(),
                _ => {
                    let mut m = me.to_vec();
                    m.push(first.clone());
                    if !modules.contains(&m) {
                        continue; // another crate (std, hyptrace_format...)
                    }
                    me.iter().chain(&p).cloned().collect()
                }
            };
            if let Some(name) = alias.or_else(|| p.last().cloned()) {
                v.push((name, abs));
            }
        }
    }
    v
}

/// A crate's files, scanned.
struct Crate {
    modules: BTreeSet<Module>,
    /// (module, name) → the path the name stands for there.
    names: BTreeMap<(Module, String), Vec<String>>,
}

impl Crate {
    /// The module of the file defining what `segs` names: the longest module prefix, and
    /// through the names modules bind (re-exports, imports) to where they come from.
    fn resolve(&self, segs: &[String]) -> Option<Module> {
        let mut segs = segs.to_vec();
        for _ in 0..16 {
            let n = (0..=segs.len())
                .rev()
                .find(|&n| self.modules.contains(&segs[..n]))?;
            let m = segs[..n].to_vec();
            let next = segs
                .get(n)
                .and_then(|name| self.names.get(&(m.clone(), name.clone())));
            match next {
                Some(t) if *t != segs[..=n] => {
                    segs = t.iter().chain(&segs[n + 1..]).cloned().collect();
                }
                _ => return Some(m),
            }
        }
        None
    }
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

/// The file-level import graph of the crate whose sources are `src`.
fn graph_of(src: &Path) -> Graph {
    let mut all = Vec::new();
    files(src, &mut all);
    if all.iter().any(|f| f.ends_with("lib.rs")) {
        // host/src/main.rs: a binary over the library, a crate of its own.
        all.retain(|f| f.strip_prefix(src).ok() != Some(Path::new("main.rs")));
    }
    let tests = test_only(src, &all);
    all.retain(|f| !tests.iter().any(|t| module_of(src, f).starts_with(t)));
    let code: Vec<(Module, String)> = all
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).expect("read");
            (module_of(src, f), product_code(&text))
        })
        .collect();
    let mut krate = Crate {
        modules: code.iter().map(|(m, _)| m.clone()).collect(),
        names: BTreeMap::new(),
    };
    for (me, c) in &code {
        for (name, abs) in bindings(me, &krate.modules, c) {
            krate.names.insert((me.clone(), name), abs);
        }
    }
    let mut g = BTreeMap::new();
    for (me, c) in &code {
        let mut deps = BTreeSet::new();
        for segs in paths(c, "crate::") {
            deps.extend(krate.resolve(&segs));
        }
        // `super::x` in `a/b.rs` (module a::b) names a::x; in `a/mod.rs` (module a), crate::x.
        let parent = &me[..me.len().saturating_sub(1)];
        for segs in paths(c, "super::") {
            let full: Vec<String> = parent.iter().chain(&segs).cloned().collect();
            deps.extend(krate.resolve(&full));
        }
        // A module's own children and its ancestors (declaring it) are not imports.
        deps.retain(|d: &Module| !(d.starts_with(me) || me.starts_with(d)));
        g.insert(me.clone(), deps);
    }
    g
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn graph() -> Graph {
    graph_of(&workspace().join("host/src"))
}

/// The source folders of every crate: crates/*/src and host/src.
fn crate_sources() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .expect("crates/")
        .map(|e| e.expect("entry").path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    v.push(workspace().join("host/src"));
    v.sort();
    v
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

/// An import cycle of `g`, as the modules around it, if there is one.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    // Depth-first search with colours; a grey node reached again closes a cycle.
    fn visit(
        n: &Module,
        g: &Graph,
        colour: &mut BTreeMap<Module, u8>,
        stack: &mut Vec<Module>,
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
            if let Some(c) = visit(n, g, &mut colour, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// No crate of the workspace has an import cycle between its files.
#[test]
fn no_import_cycle_in_any_crate() {
    let mut bad = Vec::new();
    for src in crate_sources() {
        let g = graph_of(&src);
        assert!(!g.is_empty(), "{}: no file scanned", src.display());
        if let Some(c) = find_cycle(&g) {
            let name = src.parent().unwrap_or(&src).display().to_string();
            bad.push(format!("{name}: {}", c.join(" -> ")));
        }
    }
    assert!(bad.is_empty(), "import cycles:\n{}", bad.join("\n"));
}

/// The normal `[dependencies]` of a Cargo.toml text: the package names.
fn normal_dependencies(toml: &str) -> BTreeSet<String> {
    let mut in_deps = false;
    let mut v = BTreeSet::new();
    for line in toml.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps && !line.is_empty() && !line.starts_with('#') {
            let key = line.split(['=', '.', ' ']).next().unwrap_or("").trim();
            if !key.is_empty() {
                v.insert(key.to_string());
            }
        }
    }
    v
}

/// The workspace's crates: package name → Cargo.toml text.
fn workspace_manifests() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for src in crate_sources() {
        let toml = std::fs::read_to_string(src.parent().expect("crate").join("Cargo.toml"))
            .expect("Cargo.toml");
        let name = toml
            .lines()
            .find_map(|l| l.trim().strip_prefix("name = "))
            .expect("package name")
            .trim_matches('"')
            .to_string();
        m.insert(name, toml);
    }
    m
}

/// What `krate` depends on (normal dependencies), through the workspace's crates.
fn dependency_closure(krate: &str, manifests: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![krate.to_string()];
    while let Some(k) = todo.pop() {
        let Some(toml) = manifests.get(&k) else {
            continue;
        };
        for d in normal_dependencies(toml) {
            if seen.insert(d.clone()) {
                todo.push(d);
            }
        }
    }
    seen
}

/// Crates the reader must not pull: the outputs and their compression and protobuf.
const NOT_UNDER_READER: &[&str] = &["hyptrace-output", "zstd", "prost"];

/// The reader does not depend on the output crate (nor, through the workspace's crates,
/// on zstd or prost): an embedder that only reads rings does not build them.
#[test]
fn reader_does_not_depend_on_output() {
    let deps = dependency_closure("hyptrace-reader", &workspace_manifests());
    assert!(
        deps.contains("hyptrace-abi"),
        "the scan read the reader: {deps:?}"
    );
    let bad: Vec<&&str> = NOT_UNDER_READER
        .iter()
        .filter(|n| deps.contains(**n))
        .collect();
    assert!(bad.is_empty(), "hyptrace-reader depends on {bad:?}");
}

/// The same through every crate, external ones included: `cargo tree` of the reader's
/// normal dependencies names none of them.
#[test]
fn reader_dependency_tree_has_no_output() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .current_dir(workspace())
        .args(["tree", "--offline", "-p", "hyptrace-reader", "-e", "normal"])
        .args(["--prefix", "none", "--format", "{p}"])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let names: BTreeSet<&str> = text.lines().filter_map(|l| l.split(' ').next()).collect();
    assert!(names.contains("hyptrace-format"), "{names:?}");
    let bad: Vec<&&str> = NOT_UNDER_READER
        .iter()
        .filter(|n| names.contains(**n))
        .collect();
    assert!(bad.is_empty(), "hyptrace-reader's tree holds {bad:?}");
}

/// The scan itself: it finds an upward import, a cycle and a dependency when there is one.
#[test]
fn the_scan_sees_imports() {
    let g = graph();
    let m = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Module>();
    let run = g
        .get(&m(&["pipeline", "run", "live"]))
        .expect("pipeline::run::live scanned");
    assert!(run.contains(&m(&["drain", "session"])), "{run:?}");
    assert!(
        product_code("use crate::cli::X;\n#[cfg(test)]\nmod tests { use crate::x; }")
            .contains("crate::cli")
    );
    assert!(!product_code("// crate::cli\n#[cfg(test)]\nuse crate::cli;").contains("crate::cli"));
    let mid = "#[cfg(test)]\nfn t() {\n    crate::cli::x();\n}\nfn f() { crate::vmm::y(); }\n";
    assert!(!product_code(mid).contains("crate::cli") && product_code(mid).contains("crate::vmm"));
    assert_eq!(
        paths("use crate::{drain::session::{A, B as C}, vmm};", "crate::"),
        vec![
            m(&["drain", "session", "A"]),
            m(&["drain", "session", "B"]),
            m(&["vmm"])
        ]
    );
    // A name re-exported by the root leads to the file defining it: the text sink uses
    // the output crate's error through `crate::OutputError` (lib.rs: `pub use error::…`).
    let out = graph_of(&workspace().join("crates/output/src"));
    let text = out
        .get(&m(&["sinks", "text"]))
        .expect("sinks::text scanned");
    assert!(text.contains(&m(&["error"])), "{text:?}");
    // And a cycle is found: two files importing each other, through a re-export.
    let mut g2 = out.clone();
    g2.get_mut(&m(&["error"]))
        .expect("error scanned")
        .insert(m(&["sinks", "text"]));
    assert!(find_cycle(&out).is_none() && find_cycle(&g2).is_some());
}

/// The manifest scan sees a dependency, inline or dotted, and only normal ones.
#[test]
fn the_manifest_scan_sees_dependencies() {
    let toml = "[package]\nname = \"x\"\n[dependencies]\na = \"1\"\nb.workspace = true\n\
                c = { path = \"c\" }\n[dev-dependencies]\nd = \"1\"\n[build-dependencies]\ne = \"1\"\n";
    let deps = normal_dependencies(toml);
    assert_eq!(
        deps,
        ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
    );
    let mut manifests = BTreeMap::new();
    manifests.insert("x".to_string(), toml.to_string());
    manifests.insert(
        "c".to_string(),
        "[dependencies]\nzstd = \"0.13\"\n".to_string(),
    );
    assert!(dependency_closure("x", &manifests).contains("zstd"));
}

/// The most lines a product file may have (docs/design.md, "Where things are").
const MAX_FILE_LINES: usize = 1000;

/// The product files of `src` longer than [`MAX_FILE_LINES`], with their line counts. A
/// file that is only a test module (declared `#[cfg(test)] mod x;`, e.g. a tests.rs) is
/// not product code.
fn long_files(src: &Path) -> Vec<(PathBuf, usize)> {
    let mut all = Vec::new();
    files(src, &mut all);
    let tests = test_only(src, &all);
    all.into_iter()
        .filter(|f| !tests.iter().any(|t| module_of(src, f).starts_with(t)))
        .filter_map(|f| {
            let n = std::fs::read_to_string(&f).expect("read").lines().count();
            (n > MAX_FILE_LINES).then_some((f, n))
        })
        .collect()
}

/// No product file of any crate is over 1 000 lines: each concern in the file its name says.
#[test]
fn no_product_file_over_1000_lines() {
    let mut bad = Vec::new();
    for src in crate_sources() {
        for (f, n) in long_files(&src) {
            let rel = f
                .strip_prefix(workspace())
                .unwrap_or(&f)
                .display()
                .to_string();
            bad.push(format!("{rel}: {n} lines"));
        }
    }
    assert!(
        bad.is_empty(),
        "product files over {MAX_FILE_LINES} lines:\n{}",
        bad.join("\n")
    );
}

/// The files outside host/src/cli that may mention clap: the options layer, where the
/// parsed options are declared and converted into the lower layers' typed plans.
const CLAP_FILES: &[&str] = &["host/src/pipeline/options.rs", "host/src/bench/options.rs"];

/// The files under `dirs` (relative to the workspace) outside host/src/cli and
/// [`CLAP_FILES`] whose text (code, comments and tests alike) names clap.
fn clap_outside_the_top(dirs: &[PathBuf]) -> Vec<String> {
    let mut all = Vec::new();
    for d in dirs {
        files(d, &mut all);
    }
    let mut bad: Vec<String> = all
        .iter()
        .filter_map(|f| {
            let rel = f.strip_prefix(workspace()).unwrap_or(f).to_string_lossy();
            let rel = rel.replace('\\', "/");
            let allowed = rel.starts_with("host/src/cli/") || CLAP_FILES.contains(&rel.as_str());
            let text = std::fs::read_to_string(f).expect("read");
            (!allowed && text.to_ascii_lowercase().contains("clap")).then_some(rel)
        })
        .collect();
    bad.sort();
    bad
}

/// clap only at the top (issue 38): no file of any crate outside host/src/cli and the
/// options layer names clap.
#[test]
fn clap_only_at_the_top() {
    let bad = clap_outside_the_top(&crate_sources());
    assert!(
        bad.is_empty(),
        "clap outside host/src/cli and {CLAP_FILES:?}:\n{}",
        bad.join("\n")
    );
}

/// The clap scan sees the allowed files (so it is not vacuous): each names clap.
#[test]
fn the_clap_scan_sees_the_options_layer() {
    for f in CLAP_FILES {
        let text = std::fs::read_to_string(workspace().join(f)).expect("read");
        assert!(text.contains("clap"), "{f}");
    }
    let cli = std::fs::read_to_string(workspace().join("host/src/cli/mod.rs")).expect("read");
    assert!(cli.contains("clap"));
}

/// The imports of an options module (the run's `pipeline::options`, the bench's own
/// `bench::options`) by a bench module other than the bench's options layer
/// (bench/options.rs, and bench/mod.rs, which turns the parsed options into the
/// sections' typed values), as `from -> to` lines.
fn bench_imports_of_options(g: &Graph) -> Vec<String> {
    let mut bad = Vec::new();
    for (from, deps) in g {
        let below_options = from.first().map(String::as_str) == Some("bench")
            && from.get(1).is_some_and(|m| m != "options");
        if !below_options {
            continue;
        }
        for to in deps {
            if to.last().map(String::as_str) == Some("options") {
                bad.push(format!("{} -> {}", from.join("::"), to.join("::")));
            }
        }
    }
    bad
}

/// The bench's modules below its options layer take the lower layers' types (a ring
/// `Mode`, whether the guest swaps, whether the reader drains live), as the pipeline's
/// plan does, not the options' clap enums (issue 38).
#[test]
fn bench_takes_typed_values_below_its_options() {
    let bad = bench_imports_of_options(&graph());
    assert!(
        bad.is_empty(),
        "bench modules importing an options module:\n{}",
        bad.join("\n")
    );
}

/// The bench rule's scan is not vacuous: the graph has the bench's modules and their
/// imports of the pipeline, and in a graph made up of the allowed imports (bench/mod.rs
/// and bench/options.rs importing options) and one refused, the refused one is found.
#[test]
fn the_bench_scan_sees_options_imports() {
    let m = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Module>();
    let real = graph();
    let harness = real
        .get(&m(&["bench", "harness"]))
        .expect("bench::harness scanned");
    assert!(harness.contains(&m(&["pipeline", "run"])), "{harness:?}");
    let mut g = Graph::new();
    g.entry(m(&["bench"]))
        .or_default()
        .insert(m(&["pipeline", "options"]));
    g.entry(m(&["bench", "options"]))
        .or_default()
        .insert(m(&["pipeline", "options"]));
    g.entry(m(&["bench", "harness"]))
        .or_default()
        .extend([m(&["pipeline", "plan"]), m(&["pipeline", "options"])]);
    assert_eq!(
        bench_imports_of_options(&g),
        ["bench::harness -> pipeline::options"]
    );
}
