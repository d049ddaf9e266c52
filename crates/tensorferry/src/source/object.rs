//! Object stores (S3 and S3-compatible, GCS, Azure, plain HTTP(S) servers honouring
//! `Range`) through the `object_store` crate: URLs parsed into a store and a key,
//! configured from the environment and explicit options, ranged reads and multipart
//! uploads. Knows nothing of formats or devices.
//!
//! The client is async; it runs on a small tokio runtime created on first use, so the
//! API here is synchronous. Credentials never reach logs, errors or `Debug` output: URLs
//! with a user or password are refused, and error texts are scrubbed of every secret
//! value this module was given.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{
    ClientOptions, GetOptions, GetRange, MultipartUpload, ObjectStore, ObjectStoreExt,
    ObjectStoreScheme, PutPayload, RetryConfig,
};
use url::Url;

use crate::error::{Error, Result};

/// Whether `path` is a URL this module reads (`s3://`, `s3a://`, `gs://`, `az://`,
/// `abfs://`, `abfss://`, `adl://`, `azure://`, `http://`, `https://`), not a local path.
pub fn is_url(path: &Path) -> bool {
    path.to_str().is_some_and(|s| {
        let Some((scheme, rest)) = s.split_once("://") else {
            return false;
        };
        !rest.is_empty()
            && matches!(
                scheme.to_ascii_lowercase().as_str(),
                "s3" | "s3a" | "gs" | "az" | "abfs" | "abfss" | "adl" | "azure" | "http" | "https"
            )
    })
}

/// Where bytes live: a local path or an object URL. URLs travel through the rest of the
/// library as `PathBuf`s holding their text (so error messages and reports name them
/// unchanged); this tells the two apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A path on a local (or mounted) file system.
    Local(PathBuf),
    /// An object store URL.
    Url(String),
}

impl Location {
    /// Classifies `path`.
    pub fn of(path: &Path) -> Self {
        if is_url(path) {
            Self::Url(path.to_string_lossy().into_owned())
        } else {
            Self::Local(path.to_path_buf())
        }
    }

    /// `name` next to (under) this location: a path join, or for a URL the key with
    /// `/name` appended.
    pub fn join(&self, name: &str) -> PathBuf {
        match self {
            Self::Local(p) => p.join(name),
            Self::Url(u) => PathBuf::from(format!("{}/{}", u.trim_end_matches('/'), name)),
        }
    }
}

/// Configuration of object store clients: ranged-read shape, retries, timeouts, and
/// extra store options (`aws_access_key_id`, `aws_endpoint`, `google_service_account`,
/// `azure_storage_account_name`, ... as `object_store` names them), applied after the
/// environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`). `Debug` shows option keys, never values.
/// Other endpoints than the clouds' own (emulators, private links) are
/// `aws_endpoint`, `google_base_url` and `azure_storage_endpoint` (the account's blob
/// URL), with `allow_http` for plain HTTP.
#[derive(Clone)]
pub struct ObjectOptions {
    /// Extra `(key, value)` options of the store builders; they override the environment.
    pub options: Vec<(String, String)>,
    /// Retries of a failed request (5xx, 429, timeouts, dropped connections).
    pub retries: usize,
    /// Timeout of one request without progress.
    pub timeout: Duration,
    /// Read the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`) for configuration.
    pub from_env: bool,
}

impl Default for ObjectOptions {
    fn default() -> Self {
        Self {
            options: Vec::new(),
            retries: crate::settings::DEFAULT_OBJECT_RETRIES,
            timeout: Duration::from_secs(crate::settings::DEFAULT_OBJECT_TIMEOUT_S),
            from_env: true,
        }
    }
}

impl fmt::Debug for ObjectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys: Vec<&str> = self.options.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("ObjectOptions")
            .field("options", &keys)
            .field("retries", &self.retries)
            .field("timeout", &self.timeout)
            .field("from_env", &self.from_env)
            .finish()
    }
}

impl ObjectOptions {
    /// These options with `key = value` added.
    #[must_use]
    pub fn with(mut self, key: &str, value: &str) -> Self {
        self.options.push((key.to_string(), value.to_string()));
        self
    }

    fn env(&self) -> Vec<(String, String)> {
        if !self.from_env {
            return Vec::new();
        }
        std::env::vars()
            .filter(|(k, _)| {
                k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_")
            })
            .collect()
    }

    /// Every configured value that looks secret (keys, tokens, passwords), to scrub
    /// from error texts; for a JSON value (a service account key) also each of its
    /// secret-looking fields, which an error could quote alone.
    fn secrets(&self) -> Vec<String> {
        fn secret_name(k: &str) -> bool {
            let k = k.to_ascii_lowercase();
            ["secret", "key", "token", "password", "sas", "credential"]
                .iter()
                .any(|s| k.contains(s))
        }
        let mut out = Vec::new();
        for (k, v) in self.env().into_iter().chain(self.options.iter().cloned()) {
            if v.len() < 4 || !secret_name(&k) {
                continue;
            }
            if let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(&v) {
                for (name, field) in &fields {
                    if let Some(text) = field.as_str().filter(|t| t.len() >= 4) {
                        if secret_name(name) {
                            out.push(text.to_string());
                        }
                    }
                }
            }
            out.push(v);
        }
        // Longest first, so that a value containing another is replaced whole.
        out.sort_by_key(|s| std::cmp::Reverse(s.len()));
        out
    }
}

/// The runtime every object store client runs on: two worker threads, created on first
/// use and shared by the process (callers block on it from their own threads).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tensorferry-object")
            .enable_all()
            .build()
            .expect("tokio runtime for object stores")
    })
}

/// Runs `fut` to completion on the object store runtime, from a thread outside it.
pub fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    runtime().block_on(fut)
}

type StoreKey = (String, u64);

/// Clients, one per store (scheme and bucket or host) and configuration, reused so
/// connections are pooled across files and loads.
fn store_cache() -> &'static Mutex<HashMap<StoreKey, Arc<dyn ObjectStore>>> {
    static CACHE: OnceLock<Mutex<HashMap<StoreKey, Arc<dyn ObjectStore>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// One object: its store, its key, and the URL that names it.
pub struct ObjectFile {
    url: String,
    store: Arc<dyn ObjectStore>,
    key: StorePath,
    secrets: Arc<Vec<String>>,
    len: Option<u64>,
}

impl fmt::Debug for ObjectFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectFile")
            .field("url", &self.url)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

fn invalid_url(url: &str, why: &str) -> Error {
    Error::InvalidArgument(format!("{url}: {why}"))
}

impl ObjectFile {
    /// The object at `url`, not yet contacted (see [`ObjectFile::open`] for one whose
    /// size is known).
    pub fn at(url: &str, opts: &ObjectOptions) -> Result<Self> {
        let parsed = Url::parse(url).map_err(|e| invalid_url(url, &e.to_string()))?;
        // `abfs[s]://container@account.dfs.core.windows.net/key` names the container
        // where a user would be; anywhere else a user, and a password anywhere, is a
        // credential.
        let container_at = matches!(parsed.scheme(), "az" | "abfs" | "abfss");
        if (!parsed.username().is_empty() && !container_at) || parsed.password().is_some() {
            // Refused so that a secret never sits in a path that errors print.
            return Err(invalid_url(
                &redact(&parsed),
                "credentials in URLs are not accepted (use AWS_*/GOOGLE_*/AZURE_* variables or options)",
            ));
        }
        let (scheme, key) =
            ObjectStoreScheme::parse(&parsed).map_err(|e| invalid_url(url, &e.to_string()))?;
        let key = StorePath::parse(key).map_err(|e| invalid_url(url, &e.to_string()))?;
        // What one client serves: scheme, container, host and port, and for `https://`
        // URLs of a cloud store also the first path segment, which names the bucket or
        // container there (two containers of an account must not share a client).
        let base = match scheme {
            ObjectStoreScheme::Http => parsed[..url::Position::BeforePath].to_string(),
            _ if parsed.scheme() == "https" => {
                let first = parsed.path_segments().and_then(|mut s| s.next());
                format!(
                    "{}/{}",
                    &parsed[..url::Position::BeforePath],
                    first.unwrap_or("")
                )
            }
            _ => parsed[..url::Position::BeforePath].to_string(),
        };
        let mut config: Vec<(String, String)> = opts.env();
        config.extend(opts.options.iter().cloned());
        let cache_key = (base.clone(), {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            config.hash(&mut h);
            opts.retries.hash(&mut h);
            opts.timeout.hash(&mut h);
            h.finish()
        });
        let secrets = Arc::new(opts.secrets());
        let mut cache = store_cache().lock().expect("store cache lock");
        let store = if let Some(s) = cache.get(&cache_key) {
            Arc::clone(s)
        } else {
            let s = build_store(scheme, &parsed, &base, &config, opts)
                .map_err(|e| Error::InvalidArgument(format!("{url}: {}", scrub(&e, &secrets))))?;
            cache.insert(cache_key, Arc::clone(&s));
            s
        };
        drop(cache);
        Ok(Self {
            url: url.to_string(),
            store,
            key,
            secrets,
            len: None,
        })
    }

    /// The object at `url`, with its size learnt from a `HEAD` request.
    pub fn open(url: &str, opts: &ObjectOptions) -> Result<Self> {
        let mut f = Self::at(url, opts)?;
        let meta = block_on(f.store.head(&f.key)).map_err(|e| f.error("head", 0, &e))?;
        f.len = Some(meta.size);
        Ok(f)
    }

    /// The URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The object's size, when known (after [`ObjectFile::open`] or a read).
    pub fn len(&self) -> Option<u64> {
        self.len
    }

    /// Whether the object is known to be empty.
    pub fn is_empty(&self) -> bool {
        self.len == Some(0)
    }

    /// Reads the first `max` bytes (fewer when the object is shorter) with one ranged
    /// GET, learning the object's size.
    pub fn read_prefix(&mut self, max: u64) -> Result<Vec<u8>> {
        let opts = GetOptions {
            range: Some(GetRange::Bounded(0..max.max(1))),
            ..GetOptions::default()
        };
        let res = block_on(async {
            let r = self.store.get_opts(&self.key, opts).await?;
            let size = r.meta.size;
            let bytes = r.bytes().await?;
            Ok::<_, object_store::Error>((size, bytes))
        });
        match res {
            Ok((size, bytes)) => {
                self.len = Some(size);
                Ok(bytes.to_vec())
            }
            // An empty object has no byte 0 to ask for: fall back to its size.
            Err(object_store::Error::Generic { .. }) if self.len.is_none() => {
                let meta =
                    block_on(self.store.head(&self.key)).map_err(|e| self.error("head", 0, &e))?;
                self.len = Some(meta.size);
                if meta.size == 0 {
                    Ok(Vec::new())
                } else {
                    Err(self.error_text("get", 0, "ranged GET failed"))
                }
            }
            Err(e) => Err(self.error("get", 0, &e)),
        }
    }

    /// Reads `buf.len()` bytes at `offset`. The read streams into `buf`; when the
    /// connection fails part way (after the client's own retries), only the bytes still
    /// missing are asked for again, up to `retries` more times with backoff.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64, retries: usize) -> Result<()> {
        let range = offset..offset + buf.len() as u64;
        let mut sink = |at: usize, chunk: &[u8]| {
            buf[at..at + chunk.len()].copy_from_slice(chunk);
            Ok(())
        };
        self.stream_range(range, retries, &mut sink)
    }

    /// Streams `range` to `each(position in range, bytes)` in order, every byte once;
    /// a body that breaks off is resumed where it stopped (see
    /// [`ObjectFile::read_exact_at`]). `each` may block (it runs on the caller's thread).
    pub fn stream_range(
        &self,
        range: Range<u64>,
        retries: usize,
        each: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let total = range.end - range.start;
        let mut done = 0u64;
        let mut attempt = 0usize;
        while done < total {
            let from = range.start + done;
            let opts = GetOptions {
                range: Some(GetRange::Bounded(from..range.end)),
                ..GetOptions::default()
            };
            let failure = match block_on(self.store.get_opts(&self.key, opts)) {
                Ok(res) => {
                    let mut stream = res.into_stream();
                    loop {
                        match block_on(stream.next()) {
                            Some(Ok(bytes)) => {
                                let take = (bytes.len() as u64).min(total - done) as usize;
                                each(done as usize, &bytes[..take])?;
                                done += take as u64;
                                if take > 0 {
                                    attempt = 0;
                                }
                            }
                            Some(Err(e)) => break Some(e),
                            None => break None,
                        }
                    }
                }
                Err(e) => Some(e),
            };
            match failure {
                None if done < total => {
                    return Err(Error::UnexpectedEof {
                        path: PathBuf::from(&self.url),
                        at: range.start + done,
                        needed: total - done,
                    })
                }
                None => {}
                Some(e) if !is_transient(&e) || attempt >= retries => {
                    return Err(self.error("get", range.start + done, &e));
                }
                Some(e) => {
                    attempt += 1;
                    let wait = backoff(attempt);
                    log::debug!(
                        "{}: read at offset {} broke off ({}); asking again for the {} bytes left in {wait:?}",
                        self.url,
                        range.start + done,
                        scrub(&e, &self.secrets),
                        total - done
                    );
                    std::thread::sleep(wait);
                }
            }
        }
        Ok(())
    }

    /// Keys (as URLs) of the objects directly under this URL taken as a prefix ("directory").
    pub fn list_children(&self) -> Result<Vec<PathBuf>> {
        let listing = block_on(self.store.list_with_delimiter(Some(&self.key)))
            .map_err(|e| self.error("list", 0, &e))?;
        let base = self.url.trim_end_matches('/');
        Ok(listing
            .objects
            .iter()
            .filter_map(|o| {
                o.location
                    .filename()
                    .map(|n| PathBuf::from(format!("{base}/{n}")))
            })
            .collect())
    }

    /// Starts a multipart upload to this object. Nothing appears under the key until
    /// [`Upload::complete`] succeeds; dropping the upload unfinished aborts it.
    pub fn upload(&self) -> Result<Upload> {
        let up = block_on(self.store.put_multipart(&self.key))
            .map_err(|e| self.error("upload", 0, &e))?;
        Ok(Upload {
            url: self.url.clone(),
            secrets: Arc::clone(&self.secrets),
            inner: Some(up),
            pending: Vec::new(),
        })
    }

    /// Deletes the object (missing is fine).
    pub fn delete(&self) -> Result<()> {
        match block_on(self.store.delete(&self.key)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("delete", 0, &e)),
        }
    }

    fn error(&self, op: &'static str, offset: u64, e: &object_store::Error) -> Error {
        to_error(&self.url, op, offset, e, &self.secrets)
    }

    fn error_text(&self, op: &'static str, offset: u64, msg: &str) -> Error {
        Error::Io {
            path: PathBuf::from(&self.url),
            op,
            offset,
            source: std::io::Error::other(msg.to_string()),
        }
    }
}

/// A multipart upload in progress: parts go out concurrently as they are added.
/// (Parts other than the last must be at least 5 MiB on S3.)
pub struct Upload {
    url: String,
    secrets: Arc<Vec<String>>,
    inner: Option<Box<dyn MultipartUpload>>,
    pending: Vec<tokio::task::JoinHandle<object_store::Result<()>>>,
}

impl Upload {
    /// Sends `data` as the next part (parts are numbered in the order added). At most
    /// `max_in_flight` parts are in flight; this waits for the oldest beyond that.
    pub fn put_part(&mut self, data: impl Into<bytes::Bytes>, max_in_flight: usize) -> Result<()> {
        self.send(PutPayload::from(data.into()), max_in_flight)
    }

    /// Sends `chunks`, concatenated, as the next part (as [`Upload::put_part`]); each
    /// chunk's owner (a staging slot, say) is dropped once the part is sent.
    pub fn put_chunks(&mut self, chunks: Vec<bytes::Bytes>, max_in_flight: usize) -> Result<()> {
        self.send(chunks.into_iter().collect(), max_in_flight)
    }

    fn send(&mut self, payload: PutPayload, max_in_flight: usize) -> Result<()> {
        let part = self
            .inner
            .as_mut()
            .expect("upload in progress")
            .put_part(payload);
        let _guard = runtime().enter();
        self.pending.push(tokio::spawn(part));
        while self.pending.len() > max_in_flight.max(1) {
            let h = self.pending.remove(0);
            self.join(h)?;
        }
        Ok(())
    }

    fn join(&self, h: tokio::task::JoinHandle<object_store::Result<()>>) -> Result<()> {
        match block_on(h) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(to_error(&self.url, "upload part", 0, &e, &self.secrets)),
            Err(e) => Err(Error::Io {
                path: PathBuf::from(&self.url),
                op: "upload part",
                offset: 0,
                source: std::io::Error::other(e.to_string()),
            }),
        }
    }

    /// Waits for every part and completes the upload: only now does the object appear.
    /// On any failure the upload is aborted (nothing appears) and the error returned.
    pub fn complete(mut self) -> Result<()> {
        let mut first = None;
        for h in std::mem::take(&mut self.pending) {
            if let Err(e) = self.join(h) {
                first.get_or_insert(e);
            }
        }
        if let Some(e) = first {
            self.abort();
            return Err(e);
        }
        let mut up = self.inner.take().expect("upload in progress");
        match block_on(up.complete()) {
            Ok(_) => Ok(()),
            Err(e) => {
                let err = to_error(&self.url, "complete upload", 0, &e, &self.secrets);
                if let Err(a) = block_on(up.abort()) {
                    log::warn!(
                        "{}: aborting upload: {}",
                        self.url,
                        scrub(&a, &self.secrets)
                    );
                }
                Err(err)
            }
        }
    }

    /// Aborts the upload: parts sent are discarded and nothing appears under the key.
    /// Parts still in flight finish (or fail) first: one the server stored after the
    /// abort would stay behind, unseen but kept (as S3 documents for its aborts).
    pub fn abort(&mut self) {
        for h in self.pending.drain(..) {
            let _ = block_on(h);
        }
        if let Some(mut up) = self.inner.take() {
            if let Err(e) = block_on(up.abort()) {
                log::warn!(
                    "{}: aborting upload: {}",
                    self.url,
                    scrub(&e, &self.secrets)
                );
            }
        }
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        self.abort();
    }
}

fn build_store(
    scheme: ObjectStoreScheme,
    url: &Url,
    base: &str,
    config: &[(String, String)],
    opts: &ObjectOptions,
) -> object_store::Result<Arc<dyn ObjectStore>> {
    let client = ClientOptions::new()
        .with_timeout(opts.timeout)
        .with_connect_timeout(Duration::from_secs(10))
        .with_allow_http(url.scheme() == "http");
    let retry = RetryConfig {
        max_retries: opts.retries,
        retry_timeout: Duration::from_secs(crate::settings::DEFAULT_OBJECT_RETRY_WINDOW_S),
        ..RetryConfig::default()
    };
    macro_rules! build {
        ($builder:ty) => {{
            let mut b = <$builder>::new()
                .with_client_options(client)
                .with_retry(retry);
            for (k, v) in config {
                if let Ok(key) = k.to_ascii_lowercase().parse() {
                    b = b.with_config(key, v);
                }
            }
            Arc::new(b.with_url(url.as_str()).build()?) as Arc<dyn ObjectStore>
        }};
    }
    Ok(match scheme {
        ObjectStoreScheme::AmazonS3 => build!(object_store::aws::AmazonS3Builder),
        ObjectStoreScheme::GoogleCloudStorage => {
            build!(object_store::gcp::GoogleCloudStorageBuilder)
        }
        ObjectStoreScheme::MicrosoftAzure => build!(object_store::azure::MicrosoftAzureBuilder),
        ObjectStoreScheme::Http => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_client_options(client)
                .with_retry(retry)
                .with_url(base)
                .build()?,
        ),
        other => {
            return Err(object_store::Error::NotSupported {
                source: format!("{other:?} URLs").into(),
            })
        }
    })
}

/// Whether an error may go away when asked again (server errors, throttling, timeouts,
/// broken connections) rather than being permanent (missing, forbidden, bad request).
fn is_transient(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    match e {
        E::NotFound { .. }
        | E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented { .. }
        | E::Precondition { .. }
        | E::AlreadyExists { .. } => false,
        E::Generic { source, .. } => {
            let text = format!("{source:?}");
            !text.contains("status: 4") || text.contains("status: 429")
        }
        _ => true,
    }
}

fn backoff(attempt: usize) -> Duration {
    Duration::from_millis((100u64 << attempt.min(6)).min(5_000))
}

fn redact(url: &Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.to_string()
}

fn scrub(e: &dyn fmt::Display, secrets: &[String]) -> String {
    let mut s = e.to_string();
    for secret in secrets {
        s = s.replace(secret.as_str(), "***");
    }
    s
}

/// Maps an object store error to the crate's kinds: missing objects and buckets to
/// [`Error::NotFound`], refused or bad credentials to [`Error::PermissionDenied`], the
/// rest to [`Error::Io`] whose text names the URL and is scrubbed of secrets.
fn to_error(
    url: &str,
    op: &'static str,
    offset: u64,
    e: &object_store::Error,
    secrets: &[String],
) -> Error {
    use object_store::Error as E;
    let path = PathBuf::from(url);
    match e {
        E::NotFound { .. } => Error::NotFound { path },
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => Error::PermissionDenied { path },
        _ => {
            let text = scrub(e, secrets);
            let kind = if text.contains("NoSuchBucket") || text.contains("status: 404") {
                return Error::NotFound { path };
            } else if text.contains("status: 403") || text.contains("AccessDenied") {
                return Error::PermissionDenied { path };
            } else if text.to_ascii_lowercase().contains("timed out") {
                std::io::ErrorKind::TimedOut
            } else {
                std::io::ErrorKind::Other
            };
            Error::Io {
                path,
                op,
                offset,
                source: std::io::Error::new(kind, text),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_told_from_paths() {
        for u in [
            "s3://b/k",
            "https://h/x",
            "gs://b/o",
            "az://c/b",
            "HTTP://h/x",
        ] {
            assert!(is_url(Path::new(u)), "{u}");
        }
        for p in [
            "/tmp/x",
            "model.safetensors",
            "s3:/x",
            "file:///x",
            "ftp://h/x",
            "s3://",
        ] {
            assert!(!is_url(Path::new(p)), "{p}");
        }
        assert_eq!(
            Location::of(Path::new("s3://b/dir/")).join("a.json"),
            PathBuf::from("s3://b/dir/a.json")
        );
    }

    #[test]
    fn credentials_in_urls_are_refused_without_echoing_them() {
        let e = ObjectFile::at(
            "http://me:hunter22@127.0.0.1:1/x",
            &ObjectOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(!e.contains("hunter22"), "{e}");
        assert!(e.contains("credentials"), "{e}");
    }

    #[test]
    fn abfs_containers_are_no_credentials_but_passwords_are() {
        let o = ObjectOptions {
            from_env: false,
            ..ObjectOptions::default()
        }
        .with("azure_storage_account_key", "a2V5")
        .with("azure_storage_endpoint", "http://127.0.0.1:1/acct");
        let f = ObjectFile::at("abfss://models@acct.dfs.core.windows.net/x/y.bin", &o).unwrap();
        assert_eq!(f.key.as_ref(), "x/y.bin");
        for u in [
            "abfss://models:pw-sekrit@acct.dfs.core.windows.net/x",
            "gs://me@bucket/x",
        ] {
            let e = ObjectFile::at(u, &o).unwrap_err().to_string();
            assert!(e.contains("credentials") && !e.contains("pw-sekrit"), "{e}");
        }
    }

    #[test]
    fn secret_fields_of_json_values_are_scrubbed_alone_too() {
        let pem = "-----BEGIN PRIVATE KEY-----\nMIIEsekrit\n-----END PRIVATE KEY-----\n";
        let json = serde_json::json!({"private_key": pem, "client_email": "a@b.iam"}).to_string();
        let o = ObjectOptions {
            from_env: false,
            ..ObjectOptions::default()
        }
        .with("google_service_account_key", &json);
        let secrets = o.secrets();
        assert_eq!(scrub(&format!("x {json} y"), &secrets), "x *** y");
        assert_eq!(scrub(&format!("x {pem} y"), &secrets), "x *** y");
        assert_eq!(scrub(&"a@b.iam", &secrets), "a@b.iam");
    }

    #[test]
    fn debug_shows_no_option_values() {
        let o = ObjectOptions::default().with("aws_secret_access_key", "sekrit-value");
        let d = format!("{o:?}");
        assert!(
            d.contains("aws_secret_access_key") && !d.contains("sekrit-value"),
            "{d}"
        );
        assert_eq!(scrub(&"x sekrit-value y", &o.secrets()), "x *** y");
    }
}
