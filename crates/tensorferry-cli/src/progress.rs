//! A progress bar on stderr that appears only once an operation has run for a second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-progress bar hidden for its first second.
pub struct Bar {
    bar: ProgressBar,
    start: Instant,
}

impl Bar {
    /// A bar for `total` bytes, labelled `what`; `quiet` keeps it hidden for good.
    pub fn new(total: u64, what: &str, quiet: bool) -> Arc<Self> {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("template")
            .progress_chars("=> "),
        );
        bar.set_message(what.to_string());
        let start = if quiet {
            Instant::now() + Duration::from_secs(1 << 30)
        } else {
            Instant::now()
        };
        Arc::new(Self { bar, start })
    }

    /// Records progress; shows the bar once a second has passed.
    pub fn update(&self, done: u64) {
        if self.bar.is_hidden() && self.start.elapsed() > Duration::from_secs(1) {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
        self.bar.set_position(done);
    }

    /// Records progress of `total` bytes (the total learnt as the work runs).
    pub fn update_of(&self, done: u64, total: u64) {
        if self.bar.length() != Some(total) {
            self.bar.set_length(total);
        }
        self.update(done);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
