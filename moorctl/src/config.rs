//! moorctl's configuration file: where a person's moorctl finds its cluster and its
//! identity, as kubectl's kubeconfig does. `MOOR_CONFIG`, else
//! `$XDG_CONFIG_HOME/moor/moorctl.env` (`~/.config/moor/moorctl.env`), when it exists.
//! Lines `MOOR_NAME=VALUE` of the settings below, `#` comments and blank lines; a file
//! setting's relative path is read from the file's directory, so a person keeps the
//! file beside the certificates certs.sh issued (`certs.sh` writes one per person).
//! The environment and the flags win over the file.

use std::path::{Path, PathBuf};

/// The settings a configuration file may hold, and whether each names a file.
const SETTINGS: &[(&str, bool)] = &[
    ("MOOR_ENDPOINTS", false),
    ("MOOR_PREFIX", false),
    ("MOOR_NAMESPACE", false),
    ("MOOR_CACERT", true),
    ("MOOR_CERT", true),
    ("MOOR_KEY", true),
    ("MOOR_ENCRYPTION_KEY_FILE", true),
    ("MOOR_REQUEST_TIMEOUT", false),
    ("MOOR_RETRY_FOR", false),
];

/// The file moorctl reads its settings from, if any: `MOOR_CONFIG` (which must exist),
/// else the per-user default when it exists.
pub fn path() -> Result<Option<PathBuf>, String> {
    if let Some(p) = std::env::var_os("MOOR_CONFIG").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            return Err(format!("MOOR_CONFIG: {} is not a file", p.display()));
        }
        return Ok(Some(p));
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
    Ok(base
        .map(|b| b.join("moor/moorctl.env"))
        .filter(|p| p.is_file()))
}

/// The settings of configuration text `text`, read from `file` (relative paths are
/// made relative to its directory), or the first bad line.
pub fn parse(file: &Path, text: &str) -> Result<Vec<(String, String)>, String> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = format!("{}:{}", file.display(), i + 1);
        let Some((name, value)) = line.split_once('=') else {
            return Err(format!("{at}: not NAME=VALUE"));
        };
        let (name, value) = (name.trim(), value.trim());
        let Some(&(_, is_file)) = SETTINGS.iter().find(|(n, _)| *n == name) else {
            let known: Vec<&str> = SETTINGS.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "{at}: {name} is not a setting ({})",
                known.join(", ")
            ));
        };
        let value = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(value);
        let value = if is_file && !value.is_empty() && Path::new(value).is_relative() {
            dir.join(value).display().to_string()
        } else {
            value.to_string()
        };
        out.push((name.to_string(), value));
    }
    Ok(out)
}

/// Sets each setting of the configuration file the environment does not set already.
/// Called first in `main`, before any thread is started.
pub fn load() -> Result<(), String> {
    let Some(file) = path()? else {
        return Ok(());
    };
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("reading the configuration {}: {e}", file.display()))?;
    for (name, value) in parse(&file, &text)? {
        if std::env::var_os(&name).is_none() {
            std::env::set_var(name, value);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_read_with_files_beside_the_configuration() {
        let got = parse(
            Path::new("/home/ann/moor/ann.env"),
            "# Ann's moorctl\nMOOR_ENDPOINTS=https://etcd:2379\n\nMOOR_CACERT=ca.pem\n\
             MOOR_CERT=\"/etc/moor/ann.pem\"\nMOOR_KEY = ann-key.pem\n",
        )
        .unwrap();
        assert_eq!(
            got,
            vec![
                ("MOOR_ENDPOINTS".into(), "https://etcd:2379".into()),
                ("MOOR_CACERT".into(), "/home/ann/moor/ca.pem".into()),
                ("MOOR_CERT".into(), "/etc/moor/ann.pem".into()),
                ("MOOR_KEY".into(), "/home/ann/moor/ann-key.pem".into()),
            ]
        );
    }

    #[test]
    fn a_bad_line_is_refused_naming_where_it_is() {
        let f = Path::new("c.env");
        assert_eq!(
            parse(f, "MOOR_CERT\n").unwrap_err(),
            "c.env:1: not NAME=VALUE"
        );
        let e = parse(f, "\nPATH=/bin\n").unwrap_err();
        assert!(
            e.starts_with("c.env:2: PATH is not a setting (MOOR_ENDPOINTS"),
            "{e}"
        );
    }
}
