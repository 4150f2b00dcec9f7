//! Fault-drill machinery: a fault-injecting TCP proxy, a lock-holding helper process, a history
//! recorder, a history checker and an SVG timeline.
//!
//! A drill runs real clients against a real coordinator, injects faults (through the
//! [`proxy::Proxy`] between a client and its server, by signalling a [`holder::HolderProcess`],
//! or through server control), records every operation in a [`history::History`], and at the
//! end checks the history with [`checker::check`] and keeps it as evidence:
//!
//! ```no_run
//! # async fn drill() {
//! use conformance::drill::{checker::{self, CheckOptions}, history::History};
//! let history = History::new("memory_pause");
//! // … clients record into history.client("c1"), faults into history.fault(..) …
//! let violations = checker::check(&history.snapshot(), &CheckOptions::default());
//! let files = history.save(&violations).expect("write the drill's history");
//! assert!(violations.is_empty(), "see {}: {violations:#?}", files.svg.display());
//! # }
//! ```
//!
//! The files land in `target/drill-histories/<drill>.json` and `<drill>.svg`.

pub mod checker;
pub mod history;
pub mod holder;
pub mod proxy;
pub mod timeline;

pub use checker::{
    CheckOptions, MODEL_SEARCH_CAP, ModelReport, ModelVerdict, Rule, Violation, check,
    check_mutex_model,
};
pub use history::{
    ClientRecorder, FaultHandle, History, HistoryFile, Hold, Kind, Op, PendingOp, Record,
    ResourceKind, SavedFiles,
};
pub use holder::{EventFeed, HolderEvent, HolderProcess};
pub use proxy::{Fault, Proxy};
