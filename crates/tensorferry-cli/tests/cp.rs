//! `tensorferry cp` against a real `s3s-fs` server: a sharded checkpoint copied
//! local -> s3 -> local comes back byte-identical; a missing source fails with `error:`;
//! Ctrl-C stops a copy and leaves nothing.
//! Skips, saying why, when `s3s-fs` is not installed.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "cliaccesskey";
const SECRET: &str = "cli-secret-never-printed-77";

fn s3s_fs() -> Option<PathBuf> {
    [
        std::env::var_os("S3S_FS").map(PathBuf::from),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin/s3s-fs")),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.is_file())
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(root: &Path) -> Option<(Server, u16)> {
    let Some(bin) = s3s_fs() else {
        eprintln!("SKIP: s3s-fs not found (cargo install s3s-fs --version 0.14.1 --features binary --locked)");
        return None;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", KEY, "--secret-key", SECRET])
        .arg(root)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            eprintln!("SKIP: s3s-fs did not start");
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Some((server, port))
}

fn cp_command(port: u16, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tensorferry"));
    c.arg("cp")
        .args(args)
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ACCESS_KEY_ID", KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ALLOW_HTTP", "true");
    c
}

fn cp(port: u16, args: &[&str]) -> Output {
    cp_command(port, args).output().unwrap()
}

fn sharded_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tensorferry/tests/fixtures/sharded")
}

#[test]
fn cp_sharded_checkpoint_local_to_s3_to_local_is_byte_identical() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("bucket")).unwrap();
    let Some((_server, port)) = start(root.path()) else {
        return;
    };
    let src = sharded_fixture();
    let out = cp(port, &[src.to_str().unwrap(), "s3://bucket/ck", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let files = summary["files"].as_array().unwrap();
    assert!(files.len() >= 2, "{summary}");
    assert!(
        files.last().unwrap()["dst"]
            .as_str()
            .unwrap()
            .ends_with(".index.json"),
        "the index goes last: {summary}"
    );
    let back = tempfile::tempdir().unwrap();
    let dst = back.path().join("copy");
    let out = cp(port, &["s3://bucket/ck", dst.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut n = 0;
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        let name = e.file_name();
        let want = std::fs::read(e.path()).unwrap();
        let got = std::fs::read(dst.join(&name))
            .unwrap_or_else(|err| panic!("{}: {err}", name.to_string_lossy()));
        assert!(got == want, "{} differs", name.to_string_lossy());
        n += 1;
    }
    assert!(n >= 2);
    // No temporary files left behind.
    assert_eq!(std::fs::read_dir(&dst).unwrap().count(), n);
}

#[test]
fn cp_of_a_missing_source_exits_1_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let out = Command::new(env!("CARGO_BIN_EXE_tensorferry"))
        .args([
            "cp",
            missing.to_str().unwrap(),
            dir.path().join("x").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("error:") && err.contains("nope"), "{err}");
}

/// Ctrl-C during an upload: exit status 130, the multipart upload aborted (nothing under
/// the key, no parts left in the bucket), and the same copy then works.
#[test]
fn ctrl_c_during_cp_discards_the_file_in_progress() {
    let root = tempfile::tempdir().unwrap();
    let bucket = root.path().join("bucket");
    std::fs::create_dir_all(&bucket).unwrap();
    let Some((_server, port)) = start(root.path()) else {
        return;
    };
    let src_dir = tempfile::tempdir().unwrap();
    let src = src_dir.path().join("big.bin");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(384 << 20).unwrap();
    drop(f);
    let child = cp_command(port, &[src.to_str().unwrap(), "s3://bucket/big.bin"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("cancelled"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&bucket).unwrap().flatten().collect();
    assert!(left.is_empty(), "left in the bucket: {left:?}");
    // s3s-fs keeps the parts of open uploads beside the buckets; the abort removed them.
    let parts: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".upload"))
        .collect();
    assert!(parts.is_empty(), "parts of an upload left: {parts:?}");

    let out = cp(port, &[src.to_str().unwrap(), "s3://bucket/big.bin"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::metadata(bucket.join("big.bin")).unwrap().len(),
        384 << 20
    );
}
