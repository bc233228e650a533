//! Errors a person reads: what moorctl tried, what went wrong and what to do, on one line.
//! The cause chain (tonic's and hyper's wording) is for `-v`.

/// Why etcd could not be used, in words, and what to do about it.
struct Reason {
    /// Whether etcd answered (and refused) rather than not being reached.
    refused: bool,
    what: &'static str,
    hint: &'static str,
}

/// The known failures of reaching or using etcd, matched on the words the client stack
/// (tonic, hyper, rustls, the etcd server) uses for them, in order.
const REASONS: &[(&[&str], Reason)] = &[
    (
        &["database space exceeded", "nospace"],
        Reason {
            refused: true,
            what: "etcd is out of space: its backend reached its quota and raised a NOSPACE \
                   alarm, so every write in the cluster fails",
            hint: "an operator compacts, defragments and disarms the alarm (deploy/README.md, \
                   \"Space\"); `moord check` lists the alarms",
        },
    ),
    (
        &["connectionrefused", "connection refused"],
        Reason {
            refused: false,
            what: "connection refused",
            hint: "is etcd (or moord dev) running there? set --endpoints or MOOR_ENDPOINTS",
        },
    ),
    (
        &["dns error", "failed to lookup address"],
        Reason {
            refused: false,
            what: "the host name does not resolve",
            hint: "check --endpoints or MOOR_ENDPOINTS",
        },
    ),
    (
        &["unknownissuer", "unknown issuer"],
        Reason {
            refused: false,
            what: "etcd's certificate is not signed by a CA moorctl trusts",
            hint: "give the CA that signed it with --cacert or MOOR_CACERT",
        },
    ),
    (
        &["notvalidforname", "not valid for name"],
        Reason {
            refused: false,
            what: "etcd's certificate does not name the host in the endpoint",
            hint: "use the host name or address its certificate names in --endpoints",
        },
    ),
    (
        &[
            "badcertificate",
            "certificaterequired",
            "unknownca",
            "bad certificate",
        ],
        Reason {
            refused: true,
            what: "moorctl's client certificate (none given, or not signed by its CA)",
            hint: "give one signed by etcd's CA with --cert and --key (MOOR_CERT, MOOR_KEY)",
        },
    ),
    (
        &[
            "brokenpipe",
            "broken pipe",
            "connection reset",
            "http2 error",
            "connection closed",
        ],
        Reason {
            refused: false,
            what: "etcd closed the connection during setup",
            hint: "a TLS etcd needs https:// endpoints and --cacert, and with client-cert \
                   auth a certificate signed by its CA (--cert, --key)",
        },
    ),
    (
        &["authentication failed", "invalid user id or password"],
        Reason {
            refused: true,
            what: "wrong user name or password",
            hint: "check --user or MOOR_USER (NAME:PASSWORD)",
        },
    ),
    (
        &["user name is empty", "user name not found"],
        Reason {
            refused: true,
            what: "etcd requires an identity",
            hint: "give a client certificate (--cert, --key) or MOOR_USER=NAME:PASSWORD",
        },
    ),
    (
        &["permission denied"],
        Reason {
            refused: true,
            what: "permission denied",
            hint: "this identity's etcd role does not allow it (see deploy/etcd/roles.sh)",
        },
    ),
    (
        &["deadline", "timed out", "timeout"],
        Reason {
            refused: false,
            what: "no answer in time",
            hint: "is the etcd quorum up? set --endpoints or MOOR_ENDPOINTS",
        },
    ),
];

/// The error as one line a person can act on: for a failure to reach or use etcd, what
/// was tried, why it failed and what to do; anything else as its chain of causes.
pub fn explain(e: &anyhow::Error, endpoints: &[String]) -> String {
    // The user's answer (refused, not found, timed out waiting) says what it is; its
    // words ("timed out") are not etcd's.
    if let Some(r) = e.downcast_ref::<crate::Refused>() {
        return r.to_string();
    }
    let mut words = String::new();
    for cause in e.chain() {
        words.push_str(&format!("{cause} {cause:?} ").to_lowercase());
    }
    let at = endpoints.join(",");
    // A refusal that knows who asked what: said whole, with what to do.
    if let Some(denied) = e.chain().find_map(|c| match c.downcast_ref() {
        Some(d @ moor::store::StoreError::Denied { .. }) => Some(d),
        _ => None,
    }) {
        let said = denied.to_string();
        let said = said.strip_prefix("permission denied: ").unwrap_or(&said);
        return format!(
            "etcd at {at} {}; ask an operator for a role that does (deploy/etcd/roles.sh), \
             or use an identity that has one (--cert, --key)",
            said.strip_prefix("etcd ").unwrap_or(said)
        );
    }
    // A request etcd never answered names the bound it waited (send.rs, watch.rs).
    if let Some(silent) = e.chain().find_map(|c| {
        let text = c.to_string();
        let start = text
            .find("etcd did not answer")
            .or(text.find("etcd sent nothing"))?;
        let said = &text[start..];
        Some(said.split('"').next().unwrap_or(said).to_string())
    }) {
        return format!(
            "cannot reach etcd at {at}: {silent}; it accepts connections but does not answer: \
             is it paused or overloaded, or its quorum gone? (--request-timeout sets the bound)"
        );
    }
    for (needles, reason) in REASONS {
        if needles.iter().any(|n| words.contains(n)) {
            return if reason.refused {
                format!("etcd at {at} refused: {}; {}", reason.what, reason.hint)
            } else {
                format!(
                    "cannot reach etcd at {at}: {}; {}",
                    reason.what, reason.hint
                )
            };
        }
    }
    let unavailable = e.chain().any(|c| {
        c.downcast_ref::<moor::store::StoreError>()
            .is_some_and(moor::store::StoreError::is_transient)
    });
    if unavailable {
        let root = e
            .chain()
            .last()
            .map(ToString::to_string)
            .unwrap_or_default();
        return format!(
            "cannot reach etcd at {at}: {root}; is the etcd quorum up? set --endpoints or MOOR_ENDPOINTS"
        );
    }
    format!("{e:#}")
}

/// Every cause of the error, one per line, for `-v`.
pub fn causes(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for (i, cause) in e.chain().enumerate() {
        out.push_str(&format!("  {i}: {cause}\n"));
    }
    if let Some(root) = e.chain().last() {
        out.push_str(&format!("  root: {root:?}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(e: anyhow::Error) -> String {
        explain(&e, &["http://127.0.0.1:2379".to_string()])
    }

    #[test]
    fn a_refused_connection_says_what_was_tried_and_what_to_do() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = anyhow::Error::new(io).context("etcd is unavailable");
        assert_eq!(
            at(e),
            "cannot reach etcd at http://127.0.0.1:2379: connection refused; \
             is etcd (or moord dev) running there? set --endpoints or MOOR_ENDPOINTS"
        );
    }

    #[test]
    fn a_refusal_by_etcd_is_not_called_unreachable() {
        let e = anyhow::anyhow!("message: \"etcdserver: permission denied\"");
        assert!(at(e).starts_with("etcd at http://127.0.0.1:2379 refused: permission denied"));
    }

    #[test]
    fn a_refusal_names_the_identity_and_what_it_lacked() {
        let e = moor::store::StoreError::Denied {
            identity: Some("moor-view-a".into()),
            access: moor::store::Access::Write,
            what: "/moor/volumes/b/v1".into(),
            source: etcd_client::Error::GRpcStatus(tonic::Status::permission_denied(
                "etcdserver: permission denied",
            )),
        };
        assert_eq!(
            at(anyhow::Error::new(e).context("deleting volume b/v1")),
            "etcd at http://127.0.0.1:2379 refused identity moor-view-a a write of \
             /moor/volumes/b/v1; its etcd role does not grant it; ask an operator for a role \
             that does (deploy/etcd/roles.sh), or use an identity that has one (--cert, --key)"
        );
    }

    #[test]
    fn other_errors_keep_their_chain() {
        let e = anyhow::anyhow!("volume default/x not found").context("describe");
        assert_eq!(at(e), "describe: volume default/x not found");
    }
}
