//! `moord dev` as a test runs it: one process group on a free port and a temp data dir.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::bin;

/// `moord dev` (embedded store, controller, agent for node `local`, moor-hostpath).
pub struct Dev {
    child: Child,
    data: PathBuf,
}

impl Dev {
    pub fn start(data: &Path, port: u16) -> Dev {
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(data.with_extension("log")).unwrap();
        // A process group of its own: dropped, the whole of it goes (moord dev and the
        // moor-hostpath it supervises, which a kill of moord alone left running).
        let child = Command::new(bin("moord"))
            .args(["dev", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(data)
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        Dev {
            child,
            data: data.to_path_buf(),
        }
    }

    /// SIGTERM, as an operator's Ctrl-C, and wait for it to finish.
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "moord dev exited with {status}");
    }
}

impl Drop for Dev {
    /// Kills the group (a test that failed midway: the plugin and the agent's mounts
    /// would otherwise outlive it), waits, and unmounts what the dev node mounted.
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        super::unmount_below(&self.data);
    }
}
