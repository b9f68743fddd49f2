//! The docs stay true: every repository path, flag and environment variable that the README
//! and `docs/` name exists. Flags are read from the binaries' own `--help` (clap's), scripts'
//! flags from the scripts (a flag quoted alone may be any script's), environment variables
//! from the tracked sources.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use regex::Regex;
use tandem_tests::processes::binary;

/// Flags of other tools that the docs quote (cargo's, clap's own, llama.cpp's).
const FOREIGN_FLAGS: [&str; 9] = [
    "--bench",
    "--bins",
    "--release",
    "--features",
    "--workspace",
    "--test",
    "--help",
    "--draft-p-min",
    "--spec-draft-n-max",
];
/// Paths the docs name that are not in the tree: made by the user (git ignores it).
const USERS_FILES: [&str; 1] = ["deploy/api-keys.env"];
/// The folders a repository path starts with.
const TOP: &str = r"(?:runtime|proto|node|draft-node|target-node|coordinator|tests|deploy|fixtures|scripts|docs|\.ci)/";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The README, docs/ (and its benchmarks), and the other READMEs: (path, text).
fn documents() -> Vec<(PathBuf, String)> {
    let root = root();
    let mut paths = vec![
        root.join("README.md"),
        root.join("deploy/README.md"),
        root.join("fixtures/prompts/README.md"),
    ];
    for dir in ["docs", "docs/benchmarks"] {
        let mut md: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .expect("docs")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        md.sort();
        paths.extend(md);
    }
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("document");
            (p, text)
        })
        .collect()
}

/// Inline code spans of `text`.
fn spans(text: &str) -> impl Iterator<Item = &str> {
    static CODE: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let code = CODE.get_or_init(|| Regex::new(r"`([^`\n]+)`").expect("regex"));
    code.captures_iter(text)
        .map(|c| c.get(1).expect("group").as_str())
}

fn relative(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = root();
    let link = Regex::new(r"\]\(([^)#\s]+)").expect("regex");
    let path =
        Regex::new(&format!(r"(?:^|[\s(=])((?:\.\./)?{TOP}[A-Za-z0-9_./-]*)")).expect("regex");
    let mut missing = Vec::new();
    for (doc, text) in documents() {
        let dir = doc.parent().expect("a folder");
        for l in link.captures_iter(&text) {
            let target = &l[1];
            if !target.contains("://") && !dir.join(target).exists() {
                missing.push(format!("{}: link {target}", relative(&doc)));
            }
        }
        // Commands of kubectl name resources (`deploy/coordinator`), not files.
        for span in spans(&text).filter(|s| !s.contains("kubectl")) {
            for p in path.captures_iter(span) {
                let p = p[1].trim_end_matches(['.', ',', ':', ';', ')']);
                let p = p.split(':').next().unwrap_or(p);
                if p.contains(['{', '*', '<']) || USERS_FILES.contains(&p) {
                    continue;
                }
                if !root.join(p).exists() {
                    missing.push(format!("{}: {p}", relative(&doc)));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "paths the docs name that do not exist:\n{}",
        missing.join("\n")
    );
}

/// The flags of the three binaries and the coordinator's subcommands, from their `--help`.
fn binaries_flags() -> BTreeSet<String> {
    let flag = Regex::new(r"--[a-z][a-z0-9-]+").expect("regex");
    let mut flags = BTreeSet::new();
    let helps: [(&str, &[&str]); 7] = [
        ("coordinator", &["serve"]),
        ("coordinator", &["generate"]),
        ("coordinator", &["quantize"]),
        ("coordinator", &["fetch"]),
        ("coordinator", &[]),
        ("target-node", &[]),
        ("draft-node", &[]),
    ];
    for (name, sub) in helps {
        let out = Command::new(binary(name))
            .args(sub)
            .arg("--help")
            .output()
            .expect("run --help");
        assert!(out.status.success(), "{name} {sub:?} --help");
        let help = String::from_utf8_lossy(&out.stdout);
        flags.extend(flag.find_iter(&help).map(|m| m.as_str().to_string()));
    }
    flags
}

#[test]
fn every_flag_the_docs_name_is_a_binarys_or_a_scripts() {
    let ours = binaries_flags();
    // A flag quoted alone, after the script it belongs to: one of the scripts' flags.
    let scripts: String = std::fs::read_dir(root().join("scripts"))
        .expect("scripts")
        .filter_map(|e| std::fs::read_to_string(e.expect("entry").path()).ok())
        .collect();
    let flag = Regex::new(r"(?:^|[\s(\[])(--[a-z][a-z0-9-]+)").expect("regex");
    let script = Regex::new(r"(?:^|\s)(scripts/[A-Za-z0-9_.-]+)").expect("regex");
    let mut unknown = Vec::new();
    for (doc, text) in documents() {
        for span in spans(&text) {
            // A script's flags are the script's.
            let of_script = script
                .captures(span)
                .map(|s| std::fs::read_to_string(root().join(&s[1])).unwrap_or_default());
            for f in flag.captures_iter(span) {
                let f = &f[1];
                let known = match &of_script {
                    Some(script) => script.contains(f),
                    None => {
                        ours.contains(f)
                            || FOREIGN_FLAGS.contains(&f)
                            || span.trim() == f && scripts.contains(f)
                    }
                };
                if !known {
                    unknown.push(format!("{}: {f} (in `{span}`)", relative(&doc)));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "flags the docs name that nothing takes:\n{}",
        unknown.join("\n")
    );
}

#[test]
fn every_environment_variable_the_docs_name_is_read_somewhere() {
    let root = root();
    let listed = Command::new("git")
        .args(["ls-files"])
        .current_dir(&root)
        .output()
        .expect("git ls-files");
    let sources: String = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter(|f| !f.ends_with(".md") && !f.starts_with("fixtures/"))
        .filter_map(|f| std::fs::read_to_string(root.join(f)).ok())
        .collect();
    let var = Regex::new(r"TANDEM_[A-Z0-9_]+").expect("regex");
    let mut unread = BTreeSet::new();
    for (doc, text) in documents() {
        for v in var.find_iter(&text) {
            if !sources.contains(v.as_str()) {
                unread.insert(format!("{}: {}", relative(&doc), v.as_str()));
            }
        }
    }
    assert!(
        unread.is_empty(),
        "environment variables the docs name that nothing reads:\n{}",
        unread.into_iter().collect::<Vec<_>>().join("\n")
    );
}
