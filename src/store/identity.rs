//! Who a connection is to etcd: the user etcd checks its grants against, for the
//! messages that say what that identity was refused. With client-certificate auth
//! (`etcd --client-cert-auth`) etcd takes the user name from the certificate's subject
//! common name (CN); with `--user NAME:PASSWORD`, NAME. etcd 3.4 offers no "who am I"
//! call to an ordinary user, so the name is read from what the process presents.

use base64::Engine;

/// The identity `user` (NAME:PASSWORD) or the client certificate `cert_pem` gives:
/// the user name first, as etcd does (a password login wins over the certificate).
pub fn of(user: Option<&str>, cert_pem: Option<&[u8]>) -> Option<String> {
    if let Some(user) = user {
        let name = user.split_once(':').map_or(user, |(name, _)| name);
        return (!name.is_empty()).then(|| name.to_string());
    }
    common_name_of_pem(cert_pem?)
}

/// The subject common name of the first certificate in `pem`; `None` when there is no
/// certificate or it names none. A certificate that does not parse gives `None`: the
/// name only words a message.
pub fn common_name_of_pem(pem: &[u8]) -> Option<String> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let text = std::str::from_utf8(pem).ok()?;
    let body = &text[text.find(BEGIN)? + BEGIN.len()..];
    let body = &body[..body.find(END)?];
    let b64: String = body.chars().filter(|c| !c.is_whitespace()).collect();
    let der = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    common_name(&der)
}

/// One DER element: its tag, its contents, and what follows it.
fn element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
/// id-at-commonName, 2.5.4.3.
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
/// The string types a name's value may be (UTF8, Printable, Teletex, IA5, BMP is
/// left out: no etcd user is named in UTF-16).
const STRINGS: &[u8] = &[0x0c, 0x13, 0x14, 0x16];

/// The subject common name of a DER certificate (the last, as Go's crypto/x509 and so
/// etcd take it).
fn common_name(der: &[u8]) -> Option<String> {
    let (SEQUENCE, cert, _) = element(der)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = element(cert)? else {
        return None;
    };
    let mut fields = tbs;
    // [0] EXPLICIT version, when present.
    if fields.first() == Some(&0xa0) {
        fields = element(fields)?.2;
    }
    // serialNumber, signature, issuer, validity, then subject.
    for _ in 0..4 {
        fields = element(fields)?.2;
    }
    let (SEQUENCE, mut subject, _) = element(fields)? else {
        return None;
    };
    let mut name = None;
    while !subject.is_empty() {
        let (tag, mut rdn, rest) = element(subject)?;
        subject = rest;
        if tag != SET {
            return None;
        }
        while !rdn.is_empty() {
            let (SEQUENCE, pair, rest) = element(rdn)? else {
                return None;
            };
            rdn = rest;
            let (OID, oid, value) = element(pair)? else {
                return None;
            };
            let (tag, value, _) = element(value)?;
            if oid == COMMON_NAME && STRINGS.contains(&tag) {
                name = Some(String::from_utf8_lossy(value).into_owned());
            }
        }
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DER of one element.
    fn tlv(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        if body.len() < 0x80 {
            out.push(body.len() as u8);
        } else {
            out.extend([0x82, (body.len() >> 8) as u8, body.len() as u8]);
        }
        out.extend(body);
        out
    }

    fn attribute(oid: &[u8], tag: u8, value: &str) -> Vec<u8> {
        let pair = [tlv(OID, oid), tlv(tag, value.as_bytes())].concat();
        tlv(SET, &tlv(SEQUENCE, &pair))
    }

    /// A certificate's outline: version, serial, algorithm, issuer, validity, subject
    /// (the rest of a real certificate does not matter to the name).
    fn certificate(subject: &[Vec<u8>]) -> Vec<u8> {
        let tbs = [
            tlv(0xa0, &tlv(0x02, &[2])),
            tlv(0x02, &[0x01, 0x02]),
            tlv(SEQUENCE, &tlv(OID, &[0x2a, 0x86, 0x48])),
            tlv(SEQUENCE, &attribute(COMMON_NAME, 0x0c, "issuer-ca")),
            tlv(SEQUENCE, &[tlv(0x17, b"x"), tlv(0x17, b"y")].concat()),
            tlv(SEQUENCE, &subject.concat()),
        ]
        .concat();
        tlv(
            SEQUENCE,
            &[tlv(SEQUENCE, &tbs), tlv(0x03, &[0; 200])].concat(),
        )
    }

    fn pem(der: &[u8]) -> Vec<u8> {
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!(
            "junk before\n-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            lines.join("\n")
        )
        .into_bytes()
    }

    #[test]
    fn the_subject_common_name_is_the_identity_not_the_issuer_s() {
        let org = attribute(&[0x55, 0x04, 0x0a], 0x13, "moor");
        let cn = attribute(COMMON_NAME, 0x0c, "moor-view-a");
        let der = certificate(&[org, cn]);
        assert_eq!(
            common_name_of_pem(&pem(&der)).as_deref(),
            Some("moor-view-a")
        );
        // A user name wins, as etcd's password login does.
        assert_eq!(
            of(Some("bob:secret"), Some(&pem(&der))).as_deref(),
            Some("bob")
        );
        assert_eq!(of(None, Some(&pem(&der))).as_deref(), Some("moor-view-a"));
        assert_eq!(of(None, None), None);
    }

    #[test]
    fn a_certificate_without_a_name_or_that_does_not_parse_names_no_one() {
        let org = attribute(&[0x55, 0x04, 0x0a], 0x13, "moor");
        assert_eq!(common_name_of_pem(&pem(&certificate(&[org]))), None);
        assert_eq!(common_name_of_pem(b"not a certificate"), None);
        let mut der = certificate(&[attribute(COMMON_NAME, 0x0c, "x")]);
        for cut in 0..der.len() {
            // Never a panic, whatever is cut off.
            let _ = common_name(&der[..cut]);
        }
        der[1] = 0xff;
        assert_eq!(common_name(&der), None);
    }
}
