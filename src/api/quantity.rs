//! Quantities written in manifests and stored: sizes in bytes (with units) and
//! points in time (RFC 3339).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::num::NonZeroI64;
use std::time::{Duration, SystemTime};

/// A size in bytes. Manifests may write plain bytes (`1073741824`) or units (`1GiB`,
/// `512 MiB`, `2TiB`, SI `10GB`, `500kB`); it is stored as bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Size(pub u64);

impl Size {
    /// Parses plain bytes or a number with a unit.
    pub fn parse(s: &str) -> Result<Size, String> {
        let t = s.trim();
        if let Ok(n) = t.parse::<u64>() {
            return Size::checked(n);
        }
        let b = t.parse::<bytesize::ByteSize>().map_err(|_| {
            format!("{s:?} is not a size (write bytes, or e.g. 512MiB, 1GiB, 10GB)")
        })?;
        Size::checked(b.as_u64())
    }

    /// The largest size: 1 EiB (2^60 bytes). CSI carries sizes as int64; the bound
    /// leaves a plugin room to add several sizes without overflowing.
    pub const MAX: u64 = 1 << 60;

    /// `n` bytes, refused above [`Size::MAX`].
    pub fn checked(n: u64) -> Result<Size, String> {
        if n > Size::MAX {
            return Err(format!(
                "{n} bytes is too large; the largest size is {} bytes (1 EiB)",
                Size::MAX
            ));
        }
        Ok(Size(n))
    }
}

impl Size {
    /// What a person likely did not mean by this size of field `field`, said before it
    /// is applied (issue 78, item 7): under 1 MiB (a missing unit: `10` is 10 bytes),
    /// or a whole number of SI megabytes or more that is no whole number of MiB (`10GB`
    /// is 10^10 bytes, about 9.31 GiB). `None` for a size that reads as meant.
    pub fn doubt(self, field: &str) -> Option<String> {
        const MIB: u64 = 1 << 20;
        let n = self.0;
        if n < MIB {
            return Some(format!(
                "{field} is {n} bytes: a volume that small is likely a missing unit (write e.g. 512MiB or 10GiB)"
            ));
        }
        let si = [
            (1_000_000_000_000u64, "TB", "TiB"),
            (1_000_000_000, "GB", "GiB"),
            (1_000_000, "MB", "MiB"),
        ]
        .into_iter()
        .find(|(unit, _, _)| n.is_multiple_of(*unit));
        match si {
            Some((unit, si, iec)) if !n.is_multiple_of(MIB) => Some(format!(
                "{field} is {}{si} (SI: powers of 1000, {self}); if you meant {}{iec}, write that",
                n / unit,
                n / unit
            )),
            _ => None,
        }
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", bytesize::ByteSize(self.0).display().iec())
    }
}

impl Serialize for Size {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size: whole bytes, or a number with a unit such as 512MiB or 1GiB")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Size, E> {
                Size::checked(n).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Size, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "{n} is negative; a size is 0 or more bytes"
                    ))),
                }
            }
            fn visit_u128<E: serde::de::Error>(self, n: u128) -> Result<Size, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "{n} bytes is too large; the largest size is {} bytes (1 EiB)",
                        Size::MAX
                    ))),
                }
            }
            fn visit_i128<E: serde::de::Error>(self, n: i128) -> Result<Size, E> {
                match u128::try_from(n) {
                    Ok(n) => self.visit_u128(n),
                    Err(_) => Err(E::custom(format!(
                        "{n} is negative; a size is 0 or more bytes"
                    ))),
                }
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Size, E> {
                if n < 0.0 {
                    Err(E::custom(format!(
                        "{n} is negative; a size is 0 or more bytes"
                    )))
                } else if n > Size::MAX as f64 {
                    Err(E::custom(format!(
                        "{n} bytes is too large; the largest size is {} bytes (1 EiB)",
                        Size::MAX
                    )))
                } else if n.fract() != 0.0 || !n.is_finite() {
                    Err(E::custom(format!(
                        "{n} is not a whole number of bytes (write e.g. 1536MiB for 1.5GiB)"
                    )))
                } else {
                    self.visit_u64(n as u64)
                }
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Size, E> {
                Size::parse(s).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A point in time, written as RFC 3339 UTC (`2026-11-21T19:18:00.123Z`), held to the
/// millisecond (what is written) in 8 bytes, and 8 as an `Option` too: every cached
/// object carries two and each condition one.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Timestamp(NonZeroI64);

impl Timestamp {
    /// Milliseconds since the Unix epoch (before it: negative) as held: with the sign bit
    /// flipped, so that only `i64::MIN` ms, far before any RFC 3339 year, is the zero
    /// an `Option` uses.
    fn from_millis(ms: i64) -> Self {
        Timestamp(NonZeroI64::new(ms ^ i64::MIN).unwrap_or(NonZeroI64::MIN))
    }

    /// Milliseconds since the Unix epoch.
    fn millis(self) -> i64 {
        self.0.get() ^ i64::MIN
    }

    /// `t`, to the millisecond (earlier digits dropped, as when written).
    pub fn from_system(t: SystemTime) -> Self {
        let ms = match t.duration_since(SystemTime::UNIX_EPOCH) {
            Ok(after) => i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
            Err(e) => {
                let before = e.duration().as_nanos().div_ceil(1_000_000);
                i64::try_from(before).map_or(i64::MIN + 1, |b| -b)
            }
        };
        Timestamp::from_millis(ms)
    }

    /// As a `SystemTime`.
    pub fn system(self) -> SystemTime {
        let ms = self.millis();
        let d = Duration::from_millis(ms.unsigned_abs());
        if ms >= 0 {
            SystemTime::UNIX_EPOCH + d
        } else {
            SystemTime::UNIX_EPOCH - d
        }
    }

    /// The current time, to the millisecond (what is stored), so a round trip through
    /// the store is exact.
    pub fn now() -> Self {
        Timestamp::from_system(SystemTime::now())
    }

    /// Time elapsed since this timestamp (zero if it lies in the future).
    pub fn elapsed(&self) -> Duration {
        self.system().elapsed().unwrap_or_default()
    }
}

impl PartialOrd for Timestamp {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Timestamp {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.millis().cmp(&other.millis())
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({self})")
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_rfc3339_millis(self.system()))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339_weak(&s)
            .map(Timestamp::from_system)
            .map_err(|e| serde::de::Error::custom(format!("{s:?} is not an RFC 3339 time: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_accept_bytes_and_units() {
        let cases = [
            ("1024", 1024),
            ("1KiB", 1024),
            ("1GiB", 1 << 30),
            ("2 TiB", 2 << 40),
            ("512MiB", 512 << 20),
            ("10GB", 10_000_000_000),
            ("1MB", 1_000_000),
            ("500kB", 500_000),
        ];
        for (text, bytes) in cases {
            assert_eq!(Size::parse(text), Ok(Size(bytes)), "{text}");
        }
        let s: Size = serde_json::from_str("\"1GiB\"").unwrap();
        assert_eq!(s, Size(1 << 30));
        let s: Size = serde_json::from_str("42").unwrap();
        assert_eq!(s, Size(42));
        assert_eq!(serde_json::to_string(&Size(1 << 30)).unwrap(), "1073741824");
        assert!(Size::parse("lots").is_err());
        assert!(serde_json::from_str::<Size>("\"-1GiB\"").is_err());
    }

    #[test]
    fn timestamps_round_trip_rfc3339() {
        let t = Timestamp::now();
        let json = serde_json::to_string(&t).unwrap();
        let back: Timestamp = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert!(serde_json::from_str::<Timestamp>("\"yesterday\"").is_err());
        for (text, written) in [
            ("1970-01-01T00:00:00Z", "1970-01-01T00:00:00.000Z"),
            ("2026-11-21T19:18:00.123456Z", "2026-11-21T19:18:00.123Z"),
            ("9999-12-31T23:59:59.999Z", "9999-12-31T23:59:59.999Z"),
        ] {
            let t: Timestamp = serde_json::from_str(&format!("{text:?}")).unwrap();
            assert_eq!(t.to_string(), written);
        }
        let (early, late) = (
            Timestamp::from_system(SystemTime::UNIX_EPOCH - Duration::from_millis(5)),
            Timestamp::from_system(SystemTime::UNIX_EPOCH + Duration::from_millis(5)),
        );
        assert!(early < late);
        assert_eq!(
            early.system(),
            SystemTime::UNIX_EPOCH - Duration::from_millis(5)
        );
        assert_eq!(std::mem::size_of::<Option<Timestamp>>(), 8);
    }

    #[test]
    fn sizes_a_person_likely_did_not_mean_are_doubted() {
        let doubt = |s: &str| Size::parse(s).unwrap().doubt("spec.capacity_min");
        assert!(doubt("10").unwrap().contains("is 10 bytes"));
        let si = doubt("10GB").unwrap();
        assert!(
            si.contains("is 10GB (SI") && si.contains("write that") && si.contains("10GiB"),
            "{si}"
        );
        assert!(doubt("500MB").unwrap().contains("500MiB"));
        for meant in ["10GiB", "512MiB", "1MiB", "3TiB"] {
            assert_eq!(doubt(meant), None, "{meant}");
        }
    }
}
