//! This build's version as people and packages read it, and the rule for which versions
//! share what is stored.
//!
//! Cargo's version is semver (`0.3.0-dev`); what moor prints and records is the same
//! with `~` for `-` (`0.3.0~dev`): Debian orders `0.3.0~dev` before `0.3.0`, as a
//! development build comes before its release, where `0.3.0-dev` would sort after it.

/// This build's version (every moor crate has the workspace's), `-` written `~`.
pub const VERSION: &str = {
    const RAW: &[u8] = env!("CARGO_PKG_VERSION").as_bytes();
    const BYTES: [u8; RAW.len()] = {
        let mut out = [0u8; RAW.len()];
        let mut i = 0;
        while i < RAW.len() {
            out[i] = if RAW[i] == b'-' { b'~' } else { RAW[i] };
            i += 1;
        }
        out
    };
    match std::str::from_utf8(&BYTES) {
        Ok(v) => v,
        Err(_) => panic!("the package version is not UTF-8"),
    }
};

/// The `major.minor` of a version string (`0.2.0`, `0.3.0~dev`, `0.2.0-rc.1`): while
/// 0.x, a minor version is a release whose stored objects or flags users may have to
/// act on.
pub fn minor_of(version: &str) -> Option<(u64, u64)> {
    let mut parts = version.split(['.', '-', '~', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Whether what `writer` stored is of a later minor version than this build reads
/// (`None`: it cannot tell, as for a writer that does not parse).
pub fn is_newer_minor(writer: &str) -> Option<bool> {
    Some(minor_of(writer)? > minor_of(VERSION)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_development_version_is_written_as_debian_orders_it() {
        assert_eq!(VERSION, env!("CARGO_PKG_VERSION").replace('-', "~"));
        assert!(!VERSION.contains('-'));
        assert_eq!(minor_of("0.3.0~dev"), Some((0, 3)));
        assert_eq!(minor_of("0.2.0"), Some((0, 2)));
        assert_eq!(minor_of("garbage"), None);
    }

    #[test]
    fn only_a_later_minor_is_newer() {
        let (major, minor) = minor_of(VERSION).unwrap();
        assert_eq!(
            is_newer_minor(&format!("{major}.{}.0", minor + 1)),
            Some(true)
        );
        assert_eq!(is_newer_minor(&format!("{major}.{minor}.9")), Some(false));
        assert_eq!(is_newer_minor("0.1.0"), Some(false));
        assert_eq!(is_newer_minor("x"), None);
    }
}
