//! A small durable state of keyed tables, persisted as a journal of changes.
//!
//! The node agent and moor-hostpath each keep what they did (stages, publishes,
//! volumes) in a local file so a restart loses nothing. Rewriting the whole state on
//! every change made each change cost as much as the state is large: with thousands of
//! records a node's publishes became quadratic. Here each commit appends one line
//! holding only the records it changed, and the file is rewritten whole only when it
//! holds more than about twice the live records (so a change costs O(its records),
//! amortised).
//!
//! Expected flow:
//! 1. [`Journal::open`] replays the file into the state (`S`, a struct of [`Table`]s).
//!    A last line cut short by a crash is dropped: its commit never finished.
//! 2. Edit through [`Journal::state_mut`]: `insert`, `remove` and `get_mut` on a table
//!    remember each touched record's value from before.
//! 3. [`Journal::commit`] appends the touched records as one line (one commit is
//!    all-or-nothing on replay), with fdatasync when the journal is durable; if the
//!    write fails the edits are undone. [`Journal::rollback`] undoes them without
//!    writing.
//! 4. Or, where many tasks commit at once (a node agent's concurrent steps),
//!    [`Journal::commit_unsynced`] appends without the fdatasync and returns the
//!    commit's number, and [`Durability::wait`] (outside any lock on the journal)
//!    returns once that commit is on disk. Commits appended while one fdatasync runs
//!    share the next: a group commit, one fdatasync for many steps, and none of them
//!    blocks a runtime thread while the disk works.
//!
//! Line format: a JSON array of `[table, key, value]`, `value` null for a removal.

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Why a journal could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Reading or writing the file failed.
    #[error("journal {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A complete line of the file is not a valid commit.
    #[error("journal {path} is corrupt at line {line}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The journal was written by a later minor version than this build, whose
    /// records this one may misread: refused, naming both.
    #[error(
        "journal {path} was written by moor {written_by}, a later minor version than this one ({}); \
         downgrading across a minor version is not supported: run {written_by} or later (UPGRADING.md)",
        crate::version::VERSION
    )]
    Newer {
        /// The file.
        path: PathBuf,
        /// The version its stamp names.
        written_by: String,
    },
    /// A line names a table the state does not have.
    #[error("journal {path} line {line} names an unknown table {table:?}")]
    UnknownTable {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The table's name.
        table: String,
    },
}

/// A map whose changes since the last commit are remembered (with the values from
/// before, to undo them). Reads go through `Deref` to the map.
#[derive(Debug, Clone)]
pub struct Table<K, V> {
    map: BTreeMap<K, V>,
    before: BTreeMap<K, Option<V>>,
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Table {
            map: BTreeMap::new(),
            before: BTreeMap::new(),
        }
    }
}

impl<K: PartialEq, V: PartialEq> PartialEq for Table<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.map == other.map
    }
}

impl<K, V> Deref for Table<K, V> {
    type Target = BTreeMap<K, V>;
    fn deref(&self) -> &BTreeMap<K, V> {
        &self.map
    }
}

impl<K: Ord + Clone, V: Clone> Table<K, V> {
    fn remember(&mut self, key: &K) {
        if !self.before.contains_key(key) {
            self.before.insert(key.clone(), self.map.get(key).cloned());
        }
    }

    /// Inserts or replaces a record.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.remember(&key);
        self.map.insert(key, value)
    }

    /// Remembers the record at `key` if there is one; whether there is.
    fn remember_existing<Q>(&mut self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let Some((owned, _)) = self.map.get_key_value(key) else {
            return false;
        };
        let owned = owned.clone();
        self.remember(&owned);
        true
    }

    /// Removes a record.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.remember_existing(key)
            .then(|| self.map.remove(key))
            .flatten()
    }

    /// A record to change in place.
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        if !self.remember_existing(key) {
            return None;
        }
        self.map.get_mut(key)
    }
}

/// One table as the journal sees it, whatever its key and value types.
pub trait Journaled {
    /// Appends `[name, key, value]` for every record changed since the last settle
    /// (touched records whose value ended as it was are left out); returns how many.
    fn write_changes(&self, name: &str, out: &mut Vec<u8>) -> serde_json::Result<usize>;
    /// Appends `[name, key, value]` for every record.
    fn write_all(&self, name: &str, out: &mut Vec<u8>) -> serde_json::Result<usize>;
    /// Applies one replayed change.
    fn replay(
        &mut self,
        key: serde_json::Value,
        value: Option<serde_json::Value>,
    ) -> serde_json::Result<()>;
    /// Forgets the remembered values: the changes are written.
    fn settle(&mut self);
    /// Undoes every change since the last settle.
    fn rollback(&mut self);
    /// Records held.
    fn records(&self) -> usize;
}

fn push_change<K: Serialize, V: Serialize>(
    out: &mut Vec<u8>,
    name: &str,
    key: &K,
    value: Option<&V>,
) -> serde_json::Result<()> {
    if out.last() != Some(&b'[') {
        out.push(b',');
    }
    serde_json::to_writer(&mut *out, &(name, key, value))
}

impl<K, V> Journaled for Table<K, V>
where
    K: Ord + Clone + Serialize + DeserializeOwned,
    V: Clone + PartialEq + Serialize + DeserializeOwned,
{
    fn write_changes(&self, name: &str, out: &mut Vec<u8>) -> serde_json::Result<usize> {
        let mut n = 0;
        for (key, before) in &self.before {
            let now = self.map.get(key);
            if now != before.as_ref() {
                push_change(out, name, key, now)?;
                n += 1;
            }
        }
        Ok(n)
    }

    fn write_all(&self, name: &str, out: &mut Vec<u8>) -> serde_json::Result<usize> {
        for (key, value) in &self.map {
            push_change(out, name, key, Some(value))?;
        }
        Ok(self.map.len())
    }

    fn replay(
        &mut self,
        key: serde_json::Value,
        value: Option<serde_json::Value>,
    ) -> serde_json::Result<()> {
        let key: K = serde_json::from_value(key)?;
        match value {
            Some(v) => {
                self.map.insert(key, serde_json::from_value(v)?);
            }
            None => {
                self.map.remove(&key);
            }
        }
        Ok(())
    }

    fn settle(&mut self) {
        self.before.clear();
    }

    fn rollback(&mut self) {
        for (key, before) in std::mem::take(&mut self.before) {
            match before {
                Some(v) => self.map.insert(key, v),
                None => self.map.remove(&key),
            };
        }
    }

    fn records(&self) -> usize {
        self.map.len()
    }
}

/// A state made of named tables. The names are written in the file: keep them.
pub trait Tables: Default {
    /// Every table with its name.
    fn tables(&mut self) -> Vec<(&'static str, &mut dyn Journaled)>;
}

/// Commits written beyond the live records before the file is rewritten whole.
const SLACK: usize = 1024;

/// A [`Tables`] state and the file its changes are appended to.
#[derive(Debug)]
pub struct Journal<S> {
    state: S,
    path: PathBuf,
    file: Arc<File>,
    /// The file's length (a failed append is cut back to it).
    len: u64,
    /// Changes in the file (a rewrite makes it the live record count).
    written: usize,
    durable: bool,
    sync: Durability,
}

/// Which of a journal's commits are on disk; shared by the tasks that wait for theirs.
/// Commits are numbered from 1 in the order they were appended.
#[derive(Debug, Clone)]
pub struct Durability(Arc<SyncState>);

#[derive(Debug)]
struct SyncState {
    path: PathBuf,
    /// The journal's file now (a rewrite replaces it).
    file: Mutex<Arc<File>>,
    /// The number of the last commit appended.
    appended: AtomicU64,
    /// Every commit up to this number is on disk.
    synced: AtomicU64,
    /// One fdatasync at a time; those who wait meanwhile are covered by the next.
    syncing: tokio::sync::Mutex<()>,
    /// fdatasyncs made (commits over syncs is how much the group commit shares).
    syncs: AtomicU64,
    /// The file's length after the last append: what a sync begun now covers.
    appended_len: AtomicU64,
    /// The file's length known on disk (the power-cut mark).
    synced_len: AtomicU64,
    /// Where the power-cut mark is written after each sync: `<journal>.synced`, when
    /// [`POWER_CUT_MARK`] is set in the environment (tests only).
    mark: Option<PathBuf>,
    /// One mark write at a time, each with the newest length.
    mark_lock: Mutex<()>,
}

/// Set in a process's environment, its journals write after each fdatasync the length
/// of the file known to be on disk to `<journal>.synced` (not synced itself: a test
/// reads it after a SIGKILL, which keeps the page cache). A test simulates a power cut
/// by cutting the journal back to that length ([`cut_to_synced`]): what was appended
/// since is what a power cut may lose.
pub const POWER_CUT_MARK: &str = "MOOR_TEST_JOURNAL_POWER_CUT_MARK";

/// Cuts the journal at `path` back to the length its process last knew on disk (its
/// `<journal>.synced` mark, see [`POWER_CUT_MARK`]), as a power cut could; returns the
/// bytes dropped. The process must be dead.
pub fn cut_to_synced(path: &Path) -> std::io::Result<u64> {
    let mark = std::fs::read_to_string(mark_path(path))?;
    let synced: u64 = mark
        .trim()
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let len = std::fs::metadata(path)?.len();
    if synced < len {
        OpenOptions::new().write(true).open(path)?.set_len(synced)?;
    }
    Ok(len.saturating_sub(synced))
}

fn mark_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".synced");
    PathBuf::from(name)
}

impl Durability {
    fn new(path: &Path, file: Arc<File>, len: u64) -> Durability {
        let d = Durability(Arc::new(SyncState {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            appended: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            syncing: tokio::sync::Mutex::new(()),
            syncs: AtomicU64::new(0),
            appended_len: AtomicU64::new(len),
            synced_len: AtomicU64::new(0),
            mark: std::env::var_os(POWER_CUT_MARK).map(|_| mark_path(path)),
            mark_lock: Mutex::new(()),
        }));
        // What replay read was on disk, or is now treated as such.
        d.synced_len_is(len);
        d
    }

    /// The file is on disk up to `len` bytes: the power-cut mark, when kept.
    fn synced_len_is(&self, len: u64) {
        let s = &self.0;
        s.synced_len.fetch_max(len, Ordering::AcqRel);
        if let Some(mark) = &s.mark {
            let _one = s.mark_lock.lock().unwrap_or_else(|p| p.into_inner());
            let now = s.synced_len.load(Ordering::Acquire);
            let _ = std::fs::write(mark, now.to_string());
        }
    }

    /// The file's length after an append (or a rewrite).
    fn appended_to(&self, len: u64) {
        self.0.appended_len.store(len, Ordering::Release);
    }

    /// The fdatasyncs of commits made so far (inline, or for waiters), rewrites aside.
    pub fn syncs(&self) -> u64 {
        self.0.syncs.load(Ordering::Relaxed)
    }

    /// The commits appended so far.
    pub fn commits(&self) -> u64 {
        self.last_appended()
    }

    /// Returns once commit `n` (from [`Journal::commit_unsynced`]) is on disk: an
    /// fdatasync that began after it was appended has finished. The fdatasync runs on
    /// a blocking thread and covers every commit appended before it began. `true`
    /// when this wait made that fdatasync (`false`: another's covered it).
    pub async fn wait(&self, n: u64) -> Result<bool, JournalError> {
        let s = &self.0;
        if s.synced.load(Ordering::Acquire) >= n {
            return Ok(false);
        }
        let _one = s.syncing.lock().await;
        if s.synced.load(Ordering::Acquire) >= n {
            return Ok(false);
        }
        // Every commit numbered up to `upto`, and every byte up to `len`, was written
        // before these reads.
        let upto = s.appended.load(Ordering::Acquire);
        let len = s.appended_len.load(Ordering::Acquire);
        let file = s.file.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let io = |source| JournalError::Io {
            path: s.path.clone(),
            source,
        };
        s.syncs.fetch_add(1, Ordering::Relaxed);
        tokio::task::spawn_blocking(move || file.sync_data())
            .await
            .map_err(|e| io(std::io::Error::other(e)))?
            .map_err(io)?;
        s.synced.fetch_max(upto, Ordering::AcqRel);
        self.synced_len_is(len);
        Ok(true)
    }

    /// Puts commit `n` on disk before returning, with an fdatasync of `file` on this
    /// thread (the plain [`Journal::commit`]) unless one already covered it.
    fn sync_now(&self, n: u64, file: &File) -> std::io::Result<()> {
        if self.0.synced.load(Ordering::Acquire) >= n {
            return Ok(());
        }
        let upto = self.last_appended();
        let len = self.0.appended_len.load(Ordering::Acquire);
        self.0.syncs.fetch_add(1, Ordering::Relaxed);
        file.sync_data()?;
        self.synced_up_to(upto);
        self.synced_len_is(len);
        Ok(())
    }

    /// Commit `n` is on disk (synced inline, or by a rewrite).
    fn synced_up_to(&self, n: u64) {
        self.0.synced.fetch_max(n, Ordering::AcqRel);
    }

    fn appended(&self) -> u64 {
        self.0.appended.fetch_add(1, Ordering::AcqRel) + 1
    }

    fn last_appended(&self) -> u64 {
        self.0.appended.load(Ordering::Acquire)
    }

    fn replace_file(&self, file: Arc<File>) {
        *self.0.file.lock().unwrap_or_else(|p| p.into_inner()) = file;
    }
}

impl<S> Deref for Journal<S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.state
    }
}

impl<S: Tables> Journal<S> {
    /// Opens (or creates) the journal at `path` and replays it. `durable` syncs every
    /// commit to disk (fdatasync) before it returns.
    pub fn open(path: &Path, durable: bool) -> Result<Journal<S>, JournalError> {
        let io = |source| JournalError::Io {
            path: path.to_path_buf(),
            source,
        };
        // The version that last wrote it, beside it (`<file>.version`: an older build
        // that knows no stamp reads the journal as before): a later minor's is refused.
        let stamp = stamp_path(path);
        let written_by = match std::fs::read_to_string(&stamp) {
            Ok(v) => Some(v.trim().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io(e)),
        };
        if let Some(v) = written_by.as_deref() {
            if crate::version::is_newer_minor(v) == Some(true) {
                return Err(JournalError::Newer {
                    path: path.to_path_buf(),
                    written_by: v.chars().take(64).collect(),
                });
            }
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io)?;
        let mut state = S::default();
        let mut written = 0;
        // A tail without its newline is a commit a crash cut short: drop it.
        let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        for (i, line) in bytes[..complete].split(|b| *b == b'\n').enumerate() {
            if line.is_empty() {
                continue;
            }
            let corrupt = |source| JournalError::Corrupt {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            };
            let changes: Vec<(String, serde_json::Value, Option<serde_json::Value>)> =
                serde_json::from_slice(line).map_err(corrupt)?;
            let mut tables = state.tables();
            for (table, key, value) in changes {
                let Some((_, t)) = tables.iter_mut().find(|(n, _)| *n == table) else {
                    return Err(JournalError::UnknownTable {
                        path: path.to_path_buf(),
                        line: i + 1,
                        table,
                    });
                };
                t.replay(key, value).map_err(corrupt)?;
                written += 1;
            }
        }
        if complete < bytes.len() {
            file.set_len(complete as u64).map_err(io)?;
        }
        if written_by.as_deref() != Some(crate::version::VERSION) {
            write_stamp(&stamp).map_err(io)?;
        }
        let file = Arc::new(file);
        Ok(Journal {
            state,
            path: path.to_path_buf(),
            sync: Durability::new(path, file.clone(), complete as u64),
            file,
            len: complete as u64,
            written,
            durable,
        })
    }

    /// What [`Journal::commit_unsynced`]'s numbers are waited on with.
    pub fn durability(&self) -> Durability {
        self.sync.clone()
    }

    /// The state as committed (plus any uncommitted edits).
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The state to edit; [`Journal::commit`] or [`Journal::rollback`] afterwards.
    pub fn state_mut(&mut self) -> &mut S {
        &mut self.state
    }

    /// Writes the edits since the last commit, on disk before it returns when the
    /// journal is durable; on failure they are undone.
    pub fn commit(&mut self) -> Result<(), JournalError> {
        let n = self.commit_unsynced()?;
        if self.durable {
            self.sync.sync_now(n, &self.file).map_err(|e| self.io(e))?;
        }
        Ok(())
    }

    /// Appends the edits since the last commit without waiting for the disk (on
    /// failure they are undone) and returns the number to pass to [`Durability::wait`]
    /// before acting on them. The state shows the edits at once: whoever acts on a
    /// record waits for its own commit first, and commits reach the disk in order, so
    /// a crash never keeps a later commit and loses an earlier one.
    pub fn commit_unsynced(&mut self) -> Result<u64, JournalError> {
        let mut line = vec![b'['];
        let mut changes = 0;
        let serialised: serde_json::Result<()> =
            self.state.tables().into_iter().try_for_each(|(name, t)| {
                changes += t.write_changes(name, &mut line)?;
                Ok(())
            });
        if let Err(e) = serialised {
            self.rollback();
            return Err(self.io(std::io::Error::other(e)));
        }
        if changes == 0 {
            self.settle();
            return Ok(self.sync.last_appended());
        }
        line.extend_from_slice(b"]\n");
        if let Err(e) = self.append(&line) {
            self.rollback();
            return Err(e);
        }
        self.settle();
        let n = self.sync.appended();
        if !self.durable {
            self.sync.synced_up_to(n);
        }
        self.written += changes;
        let live: usize = self.state.tables().iter().map(|(_, t)| t.records()).sum();
        if self.written > 2 * live + SLACK {
            // The journal stays valid if this fails; the next commit tries again.
            if let Err(e) = self.rewrite(live) {
                tracing::warn!(error = %crate::process::error_chain(&e), "cannot compact the journal");
            }
        }
        Ok(n)
    }

    /// Undoes the edits since the last commit.
    pub fn rollback(&mut self) {
        for (_, t) in self.state.tables() {
            t.rollback();
        }
    }

    fn settle(&mut self) {
        for (_, t) in self.state.tables() {
            t.settle();
        }
    }

    fn io(&self, source: std::io::Error) -> JournalError {
        JournalError::Io {
            path: self.path.clone(),
            source,
        }
    }

    fn append(&mut self, line: &[u8]) -> Result<(), JournalError> {
        if let Err(e) = (&*self.file).write_all(line) {
            // Leave no partial line behind to be taken for a commit.
            let _ = self.file.set_len(self.len);
            return Err(self.io(e));
        }
        self.len += line.len() as u64;
        self.sync.appended_to(self.len);
        Ok(())
    }

    /// Rewrites the file with only the live records: a temp file, synced, renamed over.
    fn rewrite(&mut self, live: usize) -> Result<(), JournalError> {
        let mut line = vec![b'['];
        let serialised: serde_json::Result<()> = self
            .state
            .tables()
            .into_iter()
            .try_for_each(|(name, t)| t.write_all(name, &mut line).map(drop));
        serialised.map_err(|e| self.io(std::io::Error::other(e)))?;
        line.extend_from_slice(b"]\n");
        let tmp = self.path.with_extension("rewrite");
        let written = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&line)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)?;
            if let Some(dir) = self.path.parent().and_then(|d| File::open(d).ok()) {
                dir.sync_all()?;
            }
            OpenOptions::new().append(true).open(&self.path)
        })();
        self.file = Arc::new(written.map_err(|e| self.io(e))?);
        self.len = line.len() as u64;
        self.written = live;
        // The rewrite holds every commit appended so far, synced.
        self.sync.replace_file(self.file.clone());
        self.sync.synced_up_to(self.sync.last_appended());
        self.sync.appended_to(self.len);
        // The new file is on disk whole; the old file's length no longer applies.
        self.sync.0.synced_len.store(0, Ordering::Release);
        self.sync.synced_len_is(self.len);
        Ok(())
    }
}

/// Where the version that last wrote the journal at `path` is kept.
pub fn stamp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".version");
    PathBuf::from(name)
}

/// Writes this build's version to `stamp`, whole or not at all (a temp file, synced,
/// renamed over).
fn write_stamp(stamp: &Path) -> std::io::Result<()> {
    let mut tmp = stamp.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = File::create(&tmp)?;
    f.write_all(format!("{}\n", crate::version::VERSION).as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, stamp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, PartialEq)]
    struct State {
        names: Table<String, u32>,
        paths: Table<PathBuf, String>,
    }

    impl Tables for State {
        fn tables(&mut self) -> Vec<(&'static str, &mut dyn Journaled)> {
            vec![("names", &mut self.names), ("paths", &mut self.paths)]
        }
    }

    fn open(path: &Path) -> Journal<State> {
        Journal::open(path, true).unwrap()
    }

    #[test]
    fn a_journal_carries_its_writer_s_version_and_a_later_minor_s_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        j.state_mut().names.insert("a".into(), 1);
        j.commit().unwrap();
        drop(j);
        let stamp = std::fs::read_to_string(stamp_path(&path)).unwrap();
        assert_eq!(stamp.trim(), crate::version::VERSION);
        // An older stamp (or none, as before stamps) is read and taken over.
        std::fs::write(stamp_path(&path), "0.1.0\n").unwrap();
        assert_eq!(open(&path).names.get("a"), Some(&1));
        let stamp = std::fs::read_to_string(stamp_path(&path)).unwrap();
        assert_eq!(stamp.trim(), crate::version::VERSION);
        // A later minor's is refused, naming both versions, and left as it is.
        let (major, minor) = crate::version::minor_of(crate::version::VERSION).unwrap();
        let later = format!("{major}.{}.0", minor + 1);
        std::fs::write(stamp_path(&path), format!("{later}\n")).unwrap();
        let e = Journal::<State>::open(&path, true)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(&format!("written by moor {later}")) && e.contains(crate::version::VERSION),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(stamp_path(&path)).unwrap().trim(),
            later
        );
    }

    #[test]
    fn commits_replay_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        j.state_mut().names.insert("a".into(), 1);
        j.state_mut().paths.insert("/x".into(), "x".into());
        j.commit().unwrap();
        *j.state_mut().names.get_mut("a").unwrap() = 2;
        j.state_mut().paths.remove(Path::new("/x"));
        j.commit().unwrap();
        let again = open(&path);
        assert_eq!(again.state().names.get("a"), Some(&2));
        assert!(again.state().paths.is_empty());
        assert_eq!(again.state(), j.state());
    }

    #[test]
    fn a_rollback_or_a_failed_edit_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        j.state_mut().names.insert("keep".into(), 1);
        j.commit().unwrap();
        j.state_mut().names.insert("new".into(), 2);
        j.state_mut().names.remove("keep");
        j.rollback();
        assert_eq!(j.state().names.keys().collect::<Vec<_>>(), ["keep"]);
        j.commit().unwrap();
        assert_eq!(open(&path).state().names.len(), 1);
    }

    #[test]
    fn a_commit_touches_only_what_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        for i in 0..100 {
            j.state_mut().names.insert(format!("n{i}"), i);
        }
        j.commit().unwrap();
        let size = std::fs::metadata(&path).unwrap().len();
        j.state_mut().names.insert("n5".into(), 500);
        // Set back to what it was: no change to write.
        j.state_mut().names.insert("n6".into(), 7);
        j.state_mut().names.insert("n6".into(), 6);
        j.commit().unwrap();
        let grown = std::fs::metadata(&path).unwrap().len() - size;
        assert_eq!(grown, r#"[["names","n5",500]]"#.len() as u64 + 1);
        j.commit().unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len() - size, grown);
    }

    /// The power-cut hook: a cut keeps every commit a sync covered (inline, waited
    /// for, or by a rewrite) and drops those appended after the last sync.
    #[tokio::test]
    async fn a_power_cut_loses_only_what_no_sync_covered() {
        std::env::set_var(POWER_CUT_MARK, "1");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        j.state_mut().names.insert("inline".into(), 1);
        j.commit().unwrap();
        let d = j.durability();
        j.state_mut().names.insert("waited".into(), 2);
        let n = j.commit_unsynced().unwrap();
        d.wait(n).await.unwrap();
        j.state_mut().names.insert("unsynced".into(), 3);
        j.commit_unsynced().unwrap();
        j.state_mut().names.insert("also unsynced".into(), 4);
        j.commit_unsynced().unwrap();
        drop(j);
        assert!(cut_to_synced(&path).unwrap() > 0, "nothing was cut");
        let again = open(&path);
        let names: Vec<_> = again.state().names.keys().cloned().collect();
        assert_eq!(names, ["inline", "waited"]);
        // Cut again: nothing more goes.
        drop(again);
        assert_eq!(cut_to_synced(&path).unwrap(), 0);
    }

    #[test]
    fn a_line_cut_short_is_dropped_and_a_corrupt_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        j.state_mut().names.insert("a".into(), 1);
        j.commit().unwrap();
        drop(j);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"[["names","b",2],["na"#).unwrap();
        let mut j = open(&path);
        assert_eq!(j.state().names.len(), 1, "the torn commit is not applied");
        j.state_mut().names.insert("c".into(), 3);
        j.commit().unwrap();
        assert_eq!(open(&path).state().names.len(), 2);

        std::fs::write(&path, "[[\"names\",\"a\",1]]\nnot json\n").unwrap();
        let e = Journal::<State>::open(&path, true).unwrap_err();
        assert!(matches!(e, JournalError::Corrupt { line: 2, .. }), "{e:?}");
        std::fs::write(&path, "[[\"other\",\"a\",1]]\n").unwrap();
        let e = Journal::<State>::open(&path, true).unwrap_err();
        assert!(
            matches!(e, JournalError::UnknownTable { line: 1, .. }),
            "{e:?}"
        );
        std::fs::write(&path, "[[\"names\",\"a\",\"not a number\"]]\n").unwrap();
        let e = Journal::<State>::open(&path, true).unwrap_err();
        assert!(matches!(e, JournalError::Corrupt { line: 1, .. }), "{e:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_commits_share_their_fdatasyncs_and_each_waits_for_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let j = Arc::new(tokio::sync::Mutex::new(open(&path)));
        let sync = j.lock().await.durability();
        let tasks: Vec<_> = (0..64u32)
            .map(|i| {
                let (j, sync) = (j.clone(), sync.clone());
                tokio::spawn(async move {
                    for k in 0..8u32 {
                        let n = {
                            let mut j = j.lock().await;
                            j.state_mut().names.insert(format!("t{i}"), k);
                            j.commit_unsynced().unwrap()
                        };
                        sync.wait(n).await.unwrap();
                        assert!(sync.0.synced.load(Ordering::Acquire) >= n);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(sync.commits(), 64 * 8);
        // Each wait is covered by an fdatasync begun after its append: never more
        // syncs than commits, and with 64 tasks at once far fewer.
        assert!(
            sync.syncs() < sync.commits() / 2,
            "{} fdatasyncs for {} commits",
            sync.syncs(),
            sync.commits()
        );
        let again = open(&path);
        assert_eq!(again.state().names.len(), 64);
        assert!(again.state().names.values().all(|v| *v == 7));
    }

    #[tokio::test]
    async fn a_wait_on_a_commit_already_synced_or_rewritten_makes_no_fdatasync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        let sync = j.durability();
        j.state_mut().names.insert("a".into(), 1);
        let n = j.commit_unsynced().unwrap();
        assert_eq!(n, 1);
        sync.wait(n).await.unwrap();
        sync.wait(n).await.unwrap();
        assert_eq!(sync.syncs(), 1);
        // Nothing changed: the last number, already on disk.
        assert_eq!(j.commit_unsynced().unwrap(), 1);
        sync.wait(1).await.unwrap();
        assert_eq!(sync.syncs(), 1);
        // A rewrite syncs everything it holds.
        for i in 0..(3 * SLACK) {
            j.state_mut().names.insert("hot".into(), i as u32);
            j.commit_unsynced().unwrap();
        }
        // Each commit since the last rewrite wrote one change over the 2 live records.
        let since_rewrite = (j.written - 2) as u64;
        assert!(since_rewrite < sync.commits() - 1, "a rewrite happened");
        let before = sync.syncs();
        sync.wait(sync.commits() - since_rewrite).await.unwrap();
        assert_eq!(sync.syncs(), before, "covered by the last rewrite");
        sync.wait(sync.commits()).await.unwrap();
        drop(j);
        assert_eq!(
            open(&path).state().names.get("hot"),
            Some(&(3 * SLACK as u32 - 1))
        );
    }

    #[test]
    fn the_file_is_rewritten_when_mostly_history() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        let mut j = open(&path);
        for i in 0..(3 * SLACK) {
            j.state_mut().names.insert("hot".into(), i as u32);
            j.commit().unwrap();
        }
        assert!(j.written <= SLACK + 2, "written {}", j.written);
        let lines = std::fs::read_to_string(&path).unwrap().lines().count();
        assert!(lines <= SLACK + 2, "{lines} lines");
        assert_eq!(
            open(&path).state().names.get("hot"),
            Some(&(3 * SLACK as u32 - 1))
        );
    }
}
