//! `moorctl apply -f FILE|-`: create or update objects from manifests.

use std::io::Read;

use anyhow::Context;

use super::{ride_out, Ctx, LookAgain, Refused};
use moor::api::{parse_manifests, AnyObject, Object, Size, Spec, Volume};
use moor::store::StoreError;
use std::cell::Cell;

/// Create or update objects from manifests.
#[derive(Debug, clap::Args)]
pub struct Apply {
    /// The manifest file, or `-` for standard input.
    #[arg(short = 'f', long = "filename")]
    pub file: String,
    /// Write a volume's secrets in clear although the cluster seals secrets at rest
    /// and this moorctl has no key file (they stay readable in etcd's history and WAL
    /// until compacted).
    #[arg(long)]
    pub allow_plaintext_secrets: bool,
}

/// Reads a file, or standard input for `-`, up to the largest manifest accepted
/// ([`moor::api::MAX_MANIFEST_BYTES`]): a longer input (an endless stream, /dev/zero) is
/// refused once that much was read, never held whole.
pub fn read_input(file: &str) -> anyhow::Result<String> {
    if file == "-" {
        read_bounded(std::io::stdin().lock(), "standard input")
    } else {
        let f = std::fs::File::open(file).with_context(|| format!("reading {file}"))?;
        read_bounded(f, file)
    }
}

fn read_bounded(input: impl Read, what: &str) -> anyhow::Result<String> {
    let max = moor::api::MAX_MANIFEST_BYTES;
    let mut bytes = Vec::new();
    input
        .take(max as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {what}"))?;
    if bytes.len() > max {
        anyhow::bail!("{what}: longer than {max} bytes, the largest manifest accepted");
    }
    String::from_utf8(bytes).with_context(|| format!("reading {what}: not UTF-8 text"))
}

impl Apply {
    /// Applies a manifest whole: every document is parsed and checked first, and a
    /// refusal found before writing (a document that does not parse or validate, a
    /// kind moor writes itself, secrets this moorctl would write in clear on a cluster
    /// that seals them) refuses the whole file, with nothing written. Then each object
    /// is written, one line each; a write etcd fails (unavailable, a conflict) is
    /// reported with the objects not applied, and exit code 1.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let text = read_input(&self.file)?;
        let results = parse_manifests(&text);
        if results.is_empty() {
            eprintln!("{}: no documents", self.file);
            return Ok(1);
        }
        let total = results.len();
        // Classes applied in the same file count for its volumes (they are written
        // first when they come first, as in the file).
        let mut classes = Classes {
            incoming: results
                .iter()
                .filter_map(|r| match r {
                    Ok(AnyObject::VolumeClass(c)) => Some((**c).clone()),
                    _ => None,
                })
                .collect(),
            all: None,
        };
        let mut objects = Vec::with_capacity(total);
        let mut warnings = Vec::new();
        let mut refused = 0;
        for result in results {
            let checked = match result {
                Ok(mut obj) => match classify(ctx, &mut obj, &mut classes).await {
                    Ok(()) => check(ctx, &obj, self.allow_plaintext_secrets)
                        .await
                        .map(|warning| (obj, warning)),
                    Err(e) => Err(e),
                },
                Err(e) => Err(anyhow::Error::new(e)),
            };
            match checked {
                Ok((obj, warning)) => {
                    warnings.extend(warning);
                    objects.push(obj);
                }
                Err(e) => {
                    eprintln!("error: {}", crate::explain::explain(&e, &ctx.endpoints));
                    refused += 1;
                }
            }
        }
        if refused > 0 {
            eprintln!(
                "nothing applied: {refused} of {total} documents refused (a manifest is applied whole or not at all)"
            );
            return Ok(1);
        }
        for w in warnings {
            eprintln!("warning: {w}");
        }
        let mut not_applied = Vec::new();
        let mut last_error = String::new();
        // Once an object could not be written for `--retry-for` because etcd was
        // unavailable, the rest are not tried: they would each wait as long.
        let mut unavailable = false;
        for obj in objects {
            let name = obj.key();
            if unavailable {
                not_applied.push(name);
                continue;
            }
            match apply_any(ctx, obj).await {
                Ok(line) => outln!("{line}"),
                Err(e) => {
                    unavailable = super::is_transient(&e);
                    last_error = crate::explain::explain(&e, &ctx.endpoints);
                    eprintln!("error: {last_error}");
                    not_applied.push(name);
                }
            }
        }
        if not_applied.is_empty() {
            return Ok(0);
        }
        // Every other object was written (the lines above say how); these were not.
        eprintln!(
            "{} of {total} objects applied; not applied: {}; last error: {last_error}",
            total - not_applied.len(),
            not_applied.join(", ")
        );
        Ok(1)
    }
}

/// What volume classes do to `obj` before it is checked: a new Volume is filled from
/// its class (`moor::api::resolve`: the one it names, or the default one when it names
/// no plugin), an update of a class-made one keeps what the class filled and may not
/// raise a capacity its class forbids; a second default class is refused; an
/// Allocation whose template relies on a class is refused while the leading
/// controller does not say it knows that.
async fn classify(ctx: &Ctx, obj: &mut AnyObject, classes: &mut Classes) -> anyhow::Result<()> {
    match obj {
        // A volume naming its plugin and no class reads nothing here (a class-made
        // one it updates keeps what its class filled: `Spec::keep_on_update`, in the
        // write itself).
        AnyObject::Volume(v) if v.spec.class.is_some() || v.spec.plugin_id.is_empty() => {
            let classes = classes.all(ctx).await?;
            let what = v.key();
            match ctx.store.try_get(&v.object_key()).await? {
                None => moor::api::resolve(&mut v.spec, classes)
                    .map_err(|e| Refused(format!("{what}: {}", prefixed(e))))?,
                // What its class filled is kept by the write itself (keep_on_update).
                Some(stored) => {
                    if let Some(why) = moor::api::expansion_refused(&v.spec, &stored.spec, classes)
                    {
                        return Err(Refused(format!("{what}: {why}")).into());
                    }
                }
            }
            Ok(())
        }
        AnyObject::VolumeClass(c) if c.spec.default => {
            let other =
                classes.all(ctx).await?.iter().find(|o| {
                    o.spec.default && o.metadata.name != c.metadata.name && !o.is_deleting()
                });
            match other {
                Some(o) => Err(Refused(format!(
                    "{}: class {} is already the default; apply it with default: false first",
                    c.key(),
                    o.metadata.name
                ))
                .into()),
                None => Ok(()),
            }
        }
        AnyObject::Allocation(a) => {
            let relies = a.spec.volumes.iter().any(|r| {
                r.template
                    .as_ref()
                    .is_some_and(|t| t.class.is_some() || t.plugin_id.is_empty())
            });
            if !relies {
                return Ok(());
            }
            let leader = moor::runtime::leader::holder(&ctx.store, "controller").await?;
            let knows = leader
                .as_ref()
                .is_some_and(|r| r.features.iter().any(|f| f == moor::FEATURE_TEMPLATE_CLASS));
            if knows {
                Ok(())
            } else {
                Err(Refused(format!(
                    "{}: a template names a class (or no plugin), and the leading controller {} does not know volume classes in templates: upgrade the controller first (UPGRADING.md)",
                    a.key(),
                    match &leader {
                        Some(r) => format!("({})", moor::api::printable(&r.version)),
                        None => "(none is leading)".to_string(),
                    }
                ))
                .into())
            }
        }
        _ => Ok(()),
    }
}

/// The volume classes an apply sees: the file's own, and those stored, read once when
/// a document first needs them.
struct Classes {
    /// The file's classes.
    incoming: Vec<moor::api::VolumeClass>,
    /// Every class, once read: those stored, each replaced by the file's own of that
    /// name.
    all: Option<Vec<moor::api::VolumeClass>>,
}

impl Classes {
    async fn all(&mut self, ctx: &Ctx) -> anyhow::Result<&[moor::api::VolumeClass]> {
        if self.all.is_none() {
            let incoming = &self.incoming;
            let mut all: Vec<moor::api::VolumeClass> = ctx
                .store
                .list::<moor::api::VolumeClassSpec>(&moor::api::KeyScope::all())
                .await?
                .items
                .into_iter()
                .filter(|c| !incoming.iter().any(|i| i.metadata.name == c.metadata.name))
                .collect();
            all.extend(incoming.iter().cloned());
            self.all = Some(all);
        }
        Ok(self.all.as_deref().unwrap_or_default())
    }
}

/// Validation errors with each field under `spec.`.
fn prefixed(e: moor::api::ValidationErrors) -> String {
    e.0.iter()
        .map(|f| format!("spec.{}: {}", f.field, f.message))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The refusal (or the warning) for secrets `key` holds (`has_secrets`) that this
/// moorctl, holding no key file, would write in clear.
async fn in_clear(
    ctx: &Ctx,
    key: &str,
    has_secrets: bool,
    plaintext_ok: bool,
) -> anyhow::Result<Option<String>> {
    if !has_secrets || ctx.store.keyring().is_some() {
        return Ok(None);
    }
    let sealing = ctx.store.sealing().await?;
    if let (Some(ids), false) = (&sealing, plaintext_ok) {
        return Err(Refused(format!(
            "{}: this cluster seals secrets at rest (its controller holds key {}) and this moorctl has no --encryption-key-file: written in clear, the secrets would stay readable in etcd's history and WAL until compacted. Give the cluster's key file, or --allow-plaintext-secrets to write them anyway",
            key,
            ids.join(", ")
        ))
        .into());
    }
    Ok(Some(format!(
        "{}: its secrets are written unencrypted (this moorctl has no --encryption-key-file){}",
        key,
        if sealing.is_some() {
            "; the controller rewrites them sealed, but the clear text stays in etcd's history and WAL until compacted"
        } else {
            ""
        }
    )))
}

/// A `capacity_min` below what the stored volume has: applied (it asks for nothing the
/// volume lacks, and is how an expansion the plugin refused is withdrawn), but volumes
/// do not shrink, so said (issue 78, item 5). Best effort: one read, and no warning
/// when it fails (the write says what is wrong with the store; a check must not turn
/// an unavailable etcd into a refused document).
async fn shrink_asked(ctx: &Ctx, o: &Volume) -> anyhow::Result<Option<String>> {
    let Some(min) = o.spec.capacity_min else {
        return Ok(None);
    };
    // After one failed read, none more: a file of many volumes must not wait a
    // deadline for each before its writes say what is wrong.
    static UNREADABLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if UNREADABLE.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(None);
    }
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        ctx.store.try_get(&o.object_key()),
    )
    .await;
    let stored = match read {
        Ok(Ok(stored)) => stored,
        _ => {
            UNREADABLE.store(true, std::sync::atomic::Ordering::Relaxed);
            None
        }
    };
    let has = stored.and_then(|v| v.status.provisioning.capacity_bytes);
    Ok(has.filter(|has| *has > min.0).map(|has| {
        format!(
            "{}: spec.capacity_min {min} is below the volume's capacity {}: volumes do not shrink, it keeps {}",
            o.key(),
            Size(has),
            Size(has)
        )
    }))
}

/// What refuses `obj` before anything is written; `Ok(Some)` is a warning to print if
/// the file is applied.
async fn check(ctx: &Ctx, obj: &AnyObject, plaintext_ok: bool) -> anyhow::Result<Vec<String>> {
    match obj {
        AnyObject::Volume(o) => {
            let clear = in_clear(ctx, &o.key(), !o.spec.secrets.is_empty(), plaintext_ok).await?;
            // Sizes a person likely did not mean (`10`, `10GB`): said, and applied.
            let sizes = [
                ("spec.capacity_min", o.spec.capacity_min),
                ("spec.capacity_max", o.spec.capacity_max),
            ];
            let doubts = sizes
                .into_iter()
                .filter_map(|(field, size)| size?.doubt(field))
                .map(|d| format!("{}: {d}", o.key()));
            let shrink = shrink_asked(ctx, o).await?;
            Ok(clear.into_iter().chain(doubts).chain(shrink).collect())
        }
        AnyObject::Secret(o) => Ok(in_clear(ctx, &o.key(), !o.spec.secrets.is_empty(), plaintext_ok)
            .await?
            .into_iter()
            .collect()),
        AnyObject::Allocation(_)
        | AnyObject::Snapshot(_)
        | AnyObject::SnapshotSchedule(_)
        | AnyObject::Quota(_)
        | AnyObject::VolumeClass(_) => Ok(Vec::new()),
        other => Err(Refused(format!(
            "{}: {} objects are written by moor itself; apply Volumes, VolumeClasses, Secrets, Allocations, Snapshots, SnapshotSchedules and Quotas",
            other.key(),
            other.kind().dir()
        ))
        .into()),
    }
}

/// Writes an object [`check`] passed.
async fn apply_any(ctx: &Ctx, obj: AnyObject) -> anyhow::Result<String> {
    match obj {
        AnyObject::Volume(o) => apply_one(ctx, *o).await,
        AnyObject::Allocation(o) => apply_one(ctx, *o).await,
        AnyObject::Snapshot(o) => apply_one(ctx, *o).await,
        AnyObject::SnapshotSchedule(o) => apply_one(ctx, *o).await,
        AnyObject::Quota(o) => apply_one(ctx, *o).await,
        AnyObject::VolumeClass(o) => apply_one(ctx, *o).await,
        AnyObject::Secret(o) => apply_one(ctx, *o).await,
        other => Err(Refused(format!("{}: not applied", other.key())).into()),
    }
}

/// What apply sent for an object whose answer never came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Nothing,
    Create,
    Update,
}

/// Creates the object, or updates the stored one's spec and labels (status and
/// finalizers stay the reconcilers'). A manifest that carries a resource_version is
/// applied only over that version, so a stale copy never overwrites a newer one.
///
/// A write whose outcome is unknown (etcd unavailable: a connection reset, a member
/// gone, a deadline) is not an answer: the object is read again, on whichever member
/// answers, to learn whether the write took effect, and applied again if it did not.
/// A create that landed is recognised by its content; an update is re-applied over the
/// version now stored.
async fn apply_one<S: Spec>(ctx: &Ctx, obj: Object<S>) -> anyhow::Result<String> {
    let sent = Cell::new(Sent::Nothing);
    ride_out(ctx, |_| apply_once(ctx, &obj, &sent)).await
}

/// One read-decide-write pass of [`apply_one`]; `sent` remembers a write whose answer
/// was lost, so that finding its content stored is reported as that write.
async fn apply_once<S: Spec>(
    ctx: &Ctx,
    obj: &Object<S>,
    sent: &Cell<Sent>,
) -> anyhow::Result<String> {
    let key = obj.object_key();
    let what = format!("{}/{}", S::KIND.to_lowercase(), key.suffix());
    let yours = obj.metadata.resource_version;
    let Some(current) = ctx.store.try_get(&key).await? else {
        if yours != 0 && sent.get() == Sent::Nothing {
            return Err(Refused(format!(
                "{what}: not applied: your copy is of version {yours}, but the object no longer exists"
            )).into());
        }
        let mut fresh = obj.clone();
        fresh.status = S::Status::default();
        fresh.metadata.finalizers.clear();
        fresh.metadata.resource_version = 0;
        let before = sent.replace(Sent::Create);
        return match ctx.store.create(&fresh).await {
            Ok(_) => Ok(format!("{what} created")),
            Err(StoreError::AlreadyExists { .. }) if before != Sent::Nothing => {
                Err(LookAgain.into())
            }
            // Another writer created it between the read and the write.
            Err(StoreError::AlreadyExists { .. }) => Err(Refused(format!(
                "{what}: not applied: it was created by someone else while applying; run apply again"
            )).into()),
            Err(e) => Err(e.into()),
        };
    };
    let mut spec = obj.spec.clone();
    spec.keep_on_update(&current.spec);
    let ours = current.spec == spec && current.metadata.labels == obj.metadata.labels;
    if ours {
        return Ok(match sent.get() {
            Sent::Nothing => format!("{what} unchanged"),
            Sent::Create => format!("{what} created"),
            Sent::Update => format!("{what} configured"),
        });
    }
    let stored = current.metadata.resource_version;
    // After a lost answer the stored version may be one this apply made.
    if yours != 0 && yours != stored && sent.get() == Sent::Nothing {
        return Err(Refused(format!(
            "{what}: not applied: the stored object (version {stored}) is newer than your copy (version {yours}); get it again and re-apply"
        )).into());
    }
    if current.metadata.deletion_timestamp.is_some() {
        return Err(Refused(format!("{what}: not applied: it is being deleted")).into());
    }
    let mut next = current;
    next.spec = spec;
    next.metadata.labels = obj.metadata.labels.clone();
    let before = sent.replace(Sent::Update);
    match ctx.store.replace(&next).await {
        Ok(_) => Ok(format!("{what} configured")),
        Err(StoreError::Conflict { .. }) if before != Sent::Nothing => Err(LookAgain.into()),
        // A copy without a version applies over whatever is stored: a write between
        // our read and ours (a controller's status write, most often) is read again.
        Err(StoreError::Conflict { .. }) if yours == 0 => Err(LookAgain.into()),
        Err(StoreError::Conflict { .. }) => Err(Refused(format!(
            "{what}: not applied: it changed while applying; run apply again"
        ))
        .into()),
        Err(e) => Err(e.into()),
    }
}
