//! Test servers for object store loads: `s3s-fs` (a real S3 server over a directory,
//! checking request signatures), a tiny HTTP server honouring `Range`, and a fault proxy
//! that can answer 503, drop connections, cut bodies short and stall. The Google Cloud
//! Storage and Azure Blob servers are in `cloud.rs`.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "tfaccesskey";
pub const SECRET_KEY: &str = "tf-secret-key-do-not-print-0123";

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for_port(port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// An `s3s-fs` process serving a temp directory; buckets are its subdirectories.
pub struct S3Server {
    child: Child,
    pub root: tempfile::TempDir,
    pub port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn s3s_fs_binary() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("S3S_FS").map(PathBuf::from),
        std::env::var_os("CARGO_HOME").map(|h| PathBuf::from(h).join("bin/s3s-fs")),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin/s3s-fs")),
    ];
    let found = candidates.into_iter().flatten().find(|p| p.is_file());
    found.or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("s3s-fs"))
                .find(|p| p.is_file())
        })
    })
}

impl S3Server {
    /// Starts one, or says why not (and the test skips).
    pub fn start() -> Option<Self> {
        let Some(bin) = s3s_fs_binary() else {
            eprintln!(
                "SKIP: s3s-fs not found (cargo install s3s-fs --version 0.14.1 --features binary --locked)"
            );
            return None;
        };
        let root = tempfile::tempdir().unwrap();
        let port = free_port();
        let child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(root.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let s = Self { child, root, port };
        if !wait_for_port(port) {
            eprintln!("SKIP: s3s-fs did not start listening on port {port}");
            return None;
        }
        Some(s)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A bucket directory (created).
    pub fn bucket(&self, name: &str) -> PathBuf {
        let d = self.root.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

/// Options for a client of an S3 endpoint, with the test credentials (or `secret`).
pub fn s3_options(endpoint: &str, secret: &str) -> tensorferry::source::ObjectOptions {
    let mut o = tensorferry::source::ObjectOptions {
        from_env: false,
        ..Default::default()
    };
    o = o
        .with("aws_endpoint", endpoint)
        .with("aws_access_key_id", ACCESS_KEY)
        .with("aws_secret_access_key", secret)
        .with("aws_region", "us-east-1")
        .with("aws_allow_http", "true")
        .with("aws_virtual_hosted_style_request", "false");
    o
}

/// A one-request-at-a-time-per-connection HTTP/1.1 server of a directory, honouring
/// `Range: bytes=a-b` (and `a-`), with `ETag`, `Last-Modified` and `Content-Range`.
pub struct RangeServer {
    pub port: u16,
    pub requests: Arc<Mutex<Vec<String>>>,
}

impl RangeServer {
    pub fn start(root: &Path) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let root = root.to_path_buf();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&requests);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let root = root.clone();
                let log = Arc::clone(&log);
                std::thread::spawn(move || serve_conn(conn, &root, &log));
            }
        });
        Self { port, requests }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

pub fn read_head(r: &mut BufReader<TcpStream>) -> Option<Vec<String>> {
    let mut lines = Vec::new();
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).ok()? == 0 {
            return None;
        }
        let l = l.trim_end().to_string();
        if l.is_empty() {
            return Some(lines);
        }
        lines.push(l);
    }
}

fn header<'a>(lines: &'a [String], name: &str) -> Option<&'a str> {
    lines.iter().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

fn serve_conn(conn: TcpStream, root: &Path, log: &Mutex<Vec<String>>) {
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    while let Some(lines) = read_head(&mut r) {
        let mut parts = lines[0].split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let path = parts.next().unwrap_or("/").to_string();
        let range = header(&lines, "range").map(str::to_string);
        log.lock().unwrap().push(format!(
            "{method} {path} {}",
            range.clone().unwrap_or_default()
        ));
        let file = root.join(path.trim_start_matches('/'));
        let Ok(data) = std::fs::read(&file) else {
            let _ = out.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
            continue;
        };
        let total = data.len() as u64;
        let (status, lo, hi) = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
            Some(spec) => {
                let (a, b) = spec.split_once('-').unwrap();
                let a: u64 = a.parse().unwrap();
                let b: u64 = if b.is_empty() {
                    total - 1
                } else {
                    b.parse::<u64>().unwrap().min(total - 1)
                };
                if a >= total {
                    let _ = write!(
                        out,
                        "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{total}\r\nContent-Length: 0\r\n\r\n"
                    );
                    continue;
                }
                ("206 Partial Content", a, b + 1)
            }
            None => ("200 OK", 0, total),
        };
        let mut head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nETag: \"{total:x}-fixed\"\r\nLast-Modified: Wed, 21 Oct 2015 07:28:00 GMT\r\nAccept-Ranges: bytes\r\n",
            if method == "HEAD" { total } else { hi - lo }
        );
        if status.starts_with("206") {
            let _ = write!(head, "Content-Range: bytes {lo}-{}/{total}\r\n", hi - 1);
        }
        head.push_str("\r\n");
        if out.write_all(head.as_bytes()).is_err() {
            return;
        }
        if method != "HEAD" && out.write_all(&data[lo as usize..hi as usize]).is_err() {
            return;
        }
        if header(&lines, "connection").is_some_and(|c| c.eq_ignore_ascii_case("close")) {
            return;
        }
    }
}

/// What the proxy does to one request.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Answer `503 Slow Down` without asking upstream.
    Status503,
    /// Answer `500 Internal Server Error`.
    Status500,
    /// Close the connection without answering.
    Drop,
    /// Forward, but send only this many bytes of the body, then close.
    CutBody(usize),
    /// Wait this long before forwarding (longer than the client's timeout: a stall).
    Stall(Duration),
}

/// An HTTP-aware TCP proxy to `upstream`: one request per connection (it answers with
/// `Connection: close`), faults taken in order from `faults` by requests that `applies`
/// accepts; every request line and `Range` is logged.
pub struct FaultProxy {
    pub port: u16,
    pub faults: Arc<Mutex<VecDeque<Fault>>>,
    pub requests: Arc<Mutex<Vec<String>>>,
}

impl FaultProxy {
    /// `applies(method, range)`: whether a request may take the next fault.
    pub fn start(upstream: u16, applies: fn(&str, Option<&str>) -> bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let faults = Arc::new(Mutex::new(VecDeque::new()));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (f2, r2) = (Arc::clone(&faults), Arc::clone(&requests));
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (f, r) = (Arc::clone(&f2), Arc::clone(&r2));
                std::thread::spawn(move || {
                    let _ = proxy_one(conn, upstream, &f, &r, applies);
                });
            }
        });
        Self {
            port,
            faults,
            requests,
        }
    }

    pub fn push(&self, f: Fault) {
        self.faults.lock().unwrap().push_back(f);
    }

    pub fn pending(&self) -> usize {
        self.faults.lock().unwrap().len()
    }
}

fn proxy_one(
    conn: TcpStream,
    upstream: u16,
    faults: &Mutex<VecDeque<Fault>>,
    log: &Mutex<Vec<String>>,
    applies: fn(&str, Option<&str>) -> bool,
) -> std::io::Result<()> {
    let mut out = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let Some(lines) = read_head(&mut r) else {
        return Ok(());
    };
    let method = lines[0].split_whitespace().next().unwrap_or("").to_string();
    let range = header(&lines, "range").map(str::to_string);
    let len: usize = header(&lines, "content-length").map_or(0, |v| v.parse().unwrap_or(0));
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    let fault = if applies(&method, range.as_deref()) {
        faults.lock().unwrap().pop_front()
    } else {
        None
    };
    log.lock().unwrap().push(format!(
        "{} {} {:?}",
        lines[0],
        range.clone().unwrap_or_default(),
        fault
    ));
    match fault {
        Some(Fault::Status503) => {
            let msg = "<Error><Code>SlowDown</Code><Message>slow down</Message></Error>";
            write!(
                out,
                "HTTP/1.1 503 Slow Down\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
                msg.len()
            )?;
            return Ok(());
        }
        Some(Fault::Status500) => {
            out.write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
            return Ok(());
        }
        Some(Fault::Drop) => {
            out.shutdown(Shutdown::Both)?;
            return Ok(());
        }
        Some(Fault::Stall(d)) => std::thread::sleep(d),
        _ => {}
    }
    let mut up = TcpStream::connect(("127.0.0.1", upstream))?;
    let mut req = format!("{}\r\n", lines[0]);
    for l in &lines[1..] {
        if !l.to_ascii_lowercase().starts_with("connection:") {
            req.push_str(l);
            req.push_str("\r\n");
        }
    }
    req.push_str("Connection: close\r\n\r\n");
    up.write_all(req.as_bytes())?;
    up.write_all(&body)?;
    let mut resp = Vec::new();
    up.read_to_end(&mut resp)?;
    let head_end = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(resp.len(), |p| p + 4);
    let head = String::from_utf8_lossy(&resp[..head_end]).to_string();
    let mut new_head = String::new();
    for l in head.split("\r\n").filter(|l| !l.is_empty()) {
        if !l.to_ascii_lowercase().starts_with("connection:") {
            new_head.push_str(l);
            new_head.push_str("\r\n");
        }
    }
    new_head.push_str("Connection: close\r\n\r\n");
    out.write_all(new_head.as_bytes())?;
    let body = &resp[head_end..];
    match fault {
        Some(Fault::CutBody(n)) => {
            out.write_all(&body[..n.min(body.len())])?;
            out.flush()?;
            out.shutdown(Shutdown::Both)?;
        }
        _ => out.write_all(body)?,
    }
    Ok(())
}

/// Copies the directory tree `from` to `to`.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_tree(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}
