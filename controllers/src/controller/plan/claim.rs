//! A claim's decisions before its phase's step: whether its allocation still wants it
//! ([`wanted`]), and what its spec copies from its volume for the node agent
//! ([`node_copy`]).

use moor::api::*;

use super::super::volume_view::VolumeView;

/// Whether the claim's allocation still asks for it: present, not deleting, not
/// terminal, and the claim is one of its requests' ([`Allocation::owns`]: by its spec,
/// not only its name).
pub fn wanted(claim: &Claim, alloc: Option<&Allocation>) -> bool {
    alloc.is_some_and(|a| a.wants(claim))
}

/// The claim's spec with what the node steps take from the volume brought up to
/// date, or `None` when it is current: the secrets of the node's calls (`secrets`:
/// the volume's, or the Secrets it names, as they are now; a claim admitted by an
/// older controller has none, and a volume's secrets or a Secret may change), and the
/// capacity the node expands to once the volume was expanded past what the claim
/// says. Only for an Admitted or Published claim (the node acts on no other).
pub fn node_copy(claim: &Claim, volume: &VolumeView, secrets: &NodeSecrets) -> Option<ClaimSpec> {
    if !matches!(
        claim.status.phase,
        ClaimPhase::Admitted | ClaimPhase::Published
    ) {
        return None;
    }
    let expand = volume
        .node_expansion_bytes
        .filter(|b| claim.spec.node_expansion_bytes < Some(*b));
    let vspec = volume.spec();
    if secrets.carried_by(&vspec, &claim.spec) && expand.is_none() {
        return None;
    }
    let mut spec = claim.spec.clone();
    secrets.put_into(&vspec, &mut spec);
    if expand.is_some() {
        spec.node_expansion_bytes = expand;
    }
    Some(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(phase: ClaimPhase) -> Claim {
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            ClaimSpec {
                allocation: AllocationId::new("a1").unwrap(),
                request: Name::new("data").unwrap(),
                volume: VolumeId::new("v1").unwrap(),
                node: NodeName::new("n1").unwrap(),
                ..Default::default()
            },
        );
        c.status.phase = phase;
        c
    }

    fn alloc() -> Allocation {
        Allocation::new(
            &Namespace::default_ns(),
            Name::new("a1").unwrap(),
            AllocationSpec {
                node: NodeName::new("n1").unwrap(),
                volumes: vec![VolumeRequest {
                    name: Name::new("data").unwrap(),
                    volume: VolumeId::new("v1").unwrap(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        )
    }

    fn volume() -> Volume {
        Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        )
    }

    #[test]
    fn a_claim_is_wanted_while_its_running_allocation_asks_for_it() {
        let c = claim(ClaimPhase::Published);
        let a = alloc();
        assert!(wanted(&c, Some(&a)));
        assert!(!wanted(&c, None), "allocation gone");
        let mut stopped = a.clone();
        stopped.spec.desired_status = DesiredStatus::Stop;
        assert!(!wanted(&c, Some(&stopped)));
        let mut lost = a.clone();
        lost.status.lost = true;
        assert!(!wanted(&c, Some(&lost)));
        let mut deleting = a.clone();
        deleting.metadata.deletion_timestamp = Some(Timestamp::now());
        assert!(!wanted(&c, Some(&deleting)));
        let mut other = a.clone();
        other.spec.volumes[0].name = Name::new("logs").unwrap();
        assert!(!wanted(&c, Some(&other)), "the request is gone");
    }

    /// The node secrets of `v` with no Secret named (its own secrets).
    fn own(v: &Volume) -> NodeSecrets {
        v.node_secrets(|_| None).unwrap()
    }

    #[test]
    fn the_node_copy_follows_the_volume_s_secrets_and_expansion() {
        let c = claim(ClaimPhase::Published);
        let mut v = volume();
        assert_eq!(
            node_copy(&c, &VolumeView::of(v.clone()), &own(&v)),
            None,
            "current"
        );
        v.spec.secrets = Secrets::new([("token".to_string(), "s3".to_string())].into()).into();
        let spec = node_copy(&c, &VolumeView::of(v.clone()), &own(&v))
            .expect("the volume's secrets changed");
        assert_eq!(spec.node_secrets, v.spec.secrets);
        assert_eq!(spec.node_expansion_bytes, None);
        let mut c = c.clone();
        c.spec = spec;
        assert_eq!(
            node_copy(&c, &VolumeView::of(v.clone()), &own(&v)),
            None,
            "copied"
        );
        // A Secret rotated: the new values for both node calls, publish's apart.
        let secret = |name: &str, key: &str, value: &str| {
            Some(std::sync::Arc::new(Secret::new(
                &Namespace::default_ns(),
                Name::new(name).unwrap(),
                SecretSpec {
                    plugin_id: PluginId::new("p").unwrap(),
                    secrets: Secrets::new([(key.to_string(), value.to_string())].into()),
                },
            )))
        };
        let rotated = NodeSecrets {
            stage: secret("st", "token", "s4"),
            publish: secret("pub", "p", "1"),
        };
        let spec = node_copy(&c, &VolumeView::of(v.clone()), &rotated).expect("the Secret changed");
        assert!(rotated.carried_by(&v.spec, &spec));
        v.status.provisioning.node_expansion_bytes = Some(2 << 30);
        let spec = node_copy(&c, &VolumeView::of(v.clone()), &own(&v)).expect("expanded");
        assert_eq!(spec.node_expansion_bytes, Some(2 << 30));
        // Never back down: a claim past the volume's figure is left alone.
        let mut ahead = c.clone();
        ahead.spec.node_expansion_bytes = Some(4 << 30);
        assert_eq!(
            node_copy(&ahead, &VolumeView::of(v.clone()), &own(&v)),
            None
        );
        // Pending, Releasing or Released claims are not the node's to act on.
        for phase in [
            ClaimPhase::Pending,
            ClaimPhase::Denied,
            ClaimPhase::Releasing,
            ClaimPhase::Released,
        ] {
            assert_eq!(
                node_copy(&claim(phase), &VolumeView::of(v.clone()), &rotated),
                None,
                "{phase:?}"
            );
        }
    }
}
