//! Checks a drill's history against the safety and liveness rules of a lock with fencing.
//!
//! Definitions the rules use (all per lock key):
//!
//! * A **grant** is an acquire whose outcome is `ok` with `granted: true`. It happened at some
//!   unknown instant inside its window `[invoke, ok]`. Grant A is **definitely before** grant B
//!   when A's `ok` precedes B's `invoke`. Acquires with an unknown outcome gave the client no
//!   token, so they are no grants (the driver has already tried to undo them).
//! * A grant's **hold interval** is what its client believed: from the acquire's `ok` to the
//!   first of: the client's release *invoke* for that token (whatever its outcome), the client's
//!   `lost` record for that token, the end of the history.
//! * A grant's **definite lease** is when the coordinator must still have recorded it: from its
//!   `ok` until the earliest of its hold's end, any force-release or [`super::History::expire`] of
//!   the key after the acquire was invoked, and the latest of `invoke + ttl − slack` (the lease
//!   cannot have expired before its TTL counted from the moment the request was sent; `slack`
//!   covers clock-rate differences), each successful renewal's `invoke + ttl − slack`, and each
//!   [`Kind::Renewed`] record's local deadline (a watchdog's renewal, as the guard counts it).
//! * A write is **accepted** when its outcome is `ok`, or when its outcome is unknown but its
//!   value is in the resource's final state (then it certainly applied). Its window is
//!   `[invoke, completion]`.
//! * A grant's **write span** is `[first accepted write's invoke, last accepted write's
//!   completion]`. Two spans **overlap** when each starts before the other ends, comparing record
//!   sequence numbers (a total order consistent with real time): some accepted write of one
//!   holder may have taken effect while the other holder was also writing.
//!
//! Rules:
//!
//! * (a) [`Rule::WriteOutsideHold`]: every accepted write was invoked inside its writer's hold
//!   interval (matched by client, key and token). [`Rule::OverlappingWrites`]: no two grants'
//!   write spans overlap. [`Rule::StaleWriteAccepted`]: of two disjoint spans, the earlier one
//!   belongs to the earlier grant (by fencing token, else by definite grant order) — a write of
//!   an older grant accepted after a newer grant's write is a stale write that got in. The
//!   overlap rule is the conservative reading: a fenced resource that happened to
//!   order two concurrent writes correctly is still reported, since the history cannot show the
//!   resource's internal order.
//! * (b) [`Rule::FencingNotIncreasing`]: if grant A is definitely before grant B, A's fencing
//!   token is smaller; no two grants share a token.
//! * (c) [`Rule::StaleReleaseTookEffect`]: a release returns `true` only while its token is the
//!   current one — never once a later grant was made — and a stale release never ends a newer
//!   hold (no grant lands inside another grant's definite lease after a stale release).
//!   [`Rule::DoubleGrant`]: the same overlap without a stale release to blame. Grant C is
//!   compared with every grant B answered before it, whether or not their `[invoke, ok]`
//!   windows overlap: each was granted at the latest at its `ok`, so both were certainly held
//!   together when C's `ok` lies inside B's definite lease and B's `ok` inside C's (C's lease
//!   counts from C's invoke, so C may have been granted first and still be definite there).
//! * (d) [`Rule::AcknowledgedWriteLost`]: every acknowledged (`ok`) write is in its resource's
//!   final state: for a [`ResourceKind::Log`] its value is there; for a
//!   [`ResourceKind::Register`] the final value is the acknowledged write with the highest fencing
//!   token or a write (acknowledged or unknown) with a newer token. A resource with acknowledged
//!   writes but no final state recorded is a violation too.
//! * (e) [`Rule::Liveness`]: after the last fault healed, every client that tried (an acquire
//!   invoked after the heal, or still pending at it) was granted within `ttl + margin` of
//!   `max(heal, its first such invoke)`. Unhealed faults, and faults after which nobody tried,
//!   are violations: liveness must be exercised.
//! * (f) [`Rule::NotLinearizable`] ([`check_mutex_model`]): per key, some order of the
//!   operations, each taking effect at one instant inside its `[invoke, completion]` window, fits
//!   a single-holder mutex with leases: a grant needs the key free, or its holder's definite
//!   lease (time bound, or its `lost` record) over; a release that returned `true` needs its own
//!   grant to be the holder and frees the key; one that returned `false` changes nothing unless
//!   its grant's lease may have ended; an acquire answered busy needs some holder; a
//!   force-release or expiry frees the key. Operations that failed, timed out or are unknown
//!   (acquires, releases, force-releases) may or may not have taken effect, at any instant after
//!   their invoke. Wing & Gong search over the key's operations with memoised states
//!   `(placed set, holder, latest point)`, capped at [`MODEL_SEARCH_CAP`] states: beyond the cap
//!   the verdict is [`ModelVerdict::Inconclusive`] (no violation reported; the drills print
//!   every report). Renewals only extend definite leases; writes are left to (a)–(d).
//! * [`Rule::Malformed`]: a completion without its invoke, two completions of one operation.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    time::Duration,
};

use serde::{Deserialize, Serialize};

use super::history::{Kind, Op, Record, ResourceKind};

/// Which rule a violation breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// An accepted write outside its writer's hold interval (or with a token it was never
    /// granted).
    WriteOutsideHold,
    /// Accepted writes of two grants overlap in time.
    OverlappingWrites,
    /// An older grant's write was accepted after a newer grant's write (a stale write got in).
    StaleWriteAccepted,
    /// Fencing tokens did not strictly increase in grant order.
    FencingNotIncreasing,
    /// A release by a stale token returned `true` or ended a newer hold.
    StaleReleaseTookEffect,
    /// A grant landed inside another grant's definite lease.
    DoubleGrant,
    /// An acknowledged write is missing from its resource's final state.
    AcknowledgedWriteLost,
    /// After the faults healed, a client that tried could not acquire in time.
    Liveness,
    /// No order of the operations, each taking effect inside its window, fits a single-holder
    /// mutex with leases ([`check_mutex_model`]).
    NotLinearizable,
    /// The history itself is inconsistent.
    Malformed,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rule::WriteOutsideHold => "write outside hold",
            Rule::OverlappingWrites => "overlapping writes",
            Rule::StaleWriteAccepted => "stale write accepted",
            Rule::FencingNotIncreasing => "fencing not increasing",
            Rule::StaleReleaseTookEffect => "stale release took effect",
            Rule::DoubleGrant => "double grant",
            Rule::AcknowledgedWriteLost => "acknowledged write lost",
            Rule::Liveness => "liveness",
            Rule::NotLinearizable => "not linearizable",
            Rule::Malformed => "malformed history",
        })
    }
}

/// One broken rule, with the records that show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The rule.
    pub rule: Rule,
    /// What happened, for a person.
    pub message: String,
    /// The `seq` of the records involved.
    pub records: Vec<u64>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} (records {:?})",
            self.rule, self.message, self.records
        )
    }
}

/// Parameters of [`check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckOptions {
    /// The TTL for the liveness rule; `None`: the largest TTL an acquire asked for.
    pub ttl: Option<Duration>,
    /// Added to the TTL for the liveness rule (scheduling, backoff, a loaded machine).
    pub liveness_margin: Duration,
    /// Subtracted from a lease's TTL when computing its definite lease (clock-rate differences
    /// between client and coordinator); `None`: [`lock_core::drift_margin`] of the TTL.
    pub lease_slack: Option<Duration>,
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            ttl: None,
            liveness_margin: Duration::from_secs(2),
            lease_slack: None,
        }
    }
}

/// Checks `records` (a history's [`super::History::snapshot`], in `seq` order) and returns every
/// violation found; empty means every rule held.
pub fn check(records: &[Record], options: &CheckOptions) -> Vec<Violation> {
    let mut out = Vec::new();
    let ops = pair_operations(records, &mut out);
    let grants = grants(records, &ops);
    let end_seq = records.last().map_or(0, |r| r.seq + 1);
    let writes = accepted_writes(records, &ops);

    check_writes_inside_holds(&grants, &writes, &mut out);
    check_write_spans(&grants, &writes, &mut out);
    check_fencing(&grants, &mut out);
    check_releases_and_grants(records, &ops, &grants, options, end_seq, &mut out);
    check_final_state(records, &ops, &mut out);
    check_liveness(records, &ops, options, &mut out);
    for report in check_mutex_model(records, options) {
        if let ModelVerdict::NotLinearizable { message, records } = report.verdict {
            out.push(Violation {
                rule: Rule::NotLinearizable,
                message: format!("{}: {message}", report.key),
                records,
            });
        }
    }

    out.sort_by(|a, b| (a.rule, &a.records).cmp(&(b.rule, &b.records)));
    out.dedup();
    out
}

/// An operation: its invoke and (if any) its completion.
#[derive(Clone, Copy, Debug)]
struct Operation<'a> {
    invoke: &'a Record,
    done: Option<&'a Record>,
}

impl<'a> Operation<'a> {
    fn outcome(&self) -> Option<Kind> {
        self.done.map(|d| d.kind)
    }

    fn end_seq(&self, end_of_history: u64) -> u64 {
        self.done.map_or(end_of_history, |d| d.seq)
    }
}

fn pair_operations<'a>(records: &'a [Record], out: &mut Vec<Violation>) -> Vec<Operation<'a>> {
    let mut by_id: BTreeMap<u64, Operation<'a>> = BTreeMap::new();
    for r in records {
        let Some(id) = r.op_id else { continue };
        match r.kind {
            Kind::Invoke if by_id.contains_key(&id) => out.push(violation(
                Rule::Malformed,
                format!("operation {id} invoked twice"),
                [r],
            )),
            Kind::Invoke => {
                by_id.insert(
                    id,
                    Operation {
                        invoke: r,
                        done: None,
                    },
                );
            }
            Kind::Ok | Kind::Fail | Kind::Unknown => match by_id.get_mut(&id) {
                Some(op) if op.done.is_none() => op.done = Some(r),
                Some(op) => out.push(violation(
                    Rule::Malformed,
                    format!("operation {id} completed twice"),
                    [op.invoke, r],
                )),
                None => out.push(violation(
                    Rule::Malformed,
                    format!("operation {id} completed without an invoke"),
                    [r],
                )),
            },
            _ => {}
        }
    }
    by_id.into_values().collect()
}

/// A grant and what its client did with it.
#[derive(Clone, Debug)]
struct Grant<'a> {
    invoke: &'a Record,
    ok: &'a Record,
    client: &'a str,
    key: &'a str,
    token: Option<&'a str>,
    fencing: Option<u64>,
    ttl: Option<Duration>,
    /// End of the hold interval: the seq of the release invoke / lost record (or end of history).
    hold_end: Option<&'a Record>,
}

impl Grant<'_> {
    fn name(&self) -> String {
        match self.fencing {
            Some(f) => format!("{}'s grant #{f}", self.client),
            None => format!(
                "{}'s grant (token {})",
                self.client,
                self.token.unwrap_or("?")
            ),
        }
    }

    fn hold_end_seq(&self) -> u64 {
        self.hold_end.map_or(u64::MAX, |r| r.seq)
    }

    fn same_hold(&self, r: &Record) -> bool {
        r.client.as_deref() == Some(self.client)
            && r.key.as_deref() == Some(self.key)
            && match (self.token, r.token.as_deref()) {
                (Some(a), Some(b)) => a == b,
                _ => self.fencing.is_some() && r.fencing == self.fencing,
            }
    }
}

fn grants<'a>(records: &'a [Record], ops: &[Operation<'a>]) -> Vec<Grant<'a>> {
    let mut grants: Vec<Grant<'a>> = ops
        .iter()
        .filter(|op| op.invoke.op == Some(Op::Acquire))
        .filter_map(|op| {
            let ok = op
                .done
                .filter(|d| d.kind == Kind::Ok && d.granted == Some(true))?;
            Some(Grant {
                invoke: op.invoke,
                ok,
                client: ok.client.as_deref().unwrap_or(""),
                key: ok.key.as_deref().unwrap_or(""),
                token: ok.token.as_deref(),
                fencing: ok.fencing,
                ttl: ok.ttl_ms.or(op.invoke.ttl_ms).map(Duration::from_millis),
                hold_end: None,
            })
        })
        .collect();
    for grant in &mut grants {
        grant.hold_end = records.iter().find(|r| {
            r.seq > grant.ok.seq
                && grant.same_hold(r)
                && (r.kind == Kind::Lost || (r.kind == Kind::Invoke && r.op == Some(Op::Release)))
        });
    }
    grants.sort_by_key(|g| g.ok.seq);
    grants
}

/// An accepted write: its invoke, its completion (ok, or unknown with its value in the final
/// state).
#[derive(Clone, Copy, Debug)]
struct Write<'a> {
    invoke: &'a Record,
    done: &'a Record,
}

fn final_values(records: &[Record]) -> HashMap<&str, (&Record, &[String])> {
    records
        .iter()
        .filter(|r| r.kind == Kind::FinalState)
        .filter_map(|r| Some((r.resource.as_deref()?, (r, r.values.as_deref()?))))
        .collect()
}

fn accepted_writes<'a>(records: &'a [Record], ops: &[Operation<'a>]) -> Vec<Write<'a>> {
    let finals = final_values(records);
    ops.iter()
        .filter(|op| op.invoke.op == Some(Op::Write))
        .filter_map(|op| {
            let done = op.done?;
            let accepted = match done.kind {
                Kind::Ok => true,
                Kind::Unknown => op.invoke.resource.as_deref().is_some_and(|res| {
                    finals.get(res).is_some_and(|(_, values)| {
                        op.invoke.value.as_ref().is_some_and(|v| values.contains(v))
                    })
                }),
                _ => false,
            };
            accepted.then_some(Write {
                invoke: op.invoke,
                done,
            })
        })
        .collect()
}

fn writer<'g, 'a>(grants: &'g [Grant<'a>], w: &Write<'a>) -> Option<&'g Grant<'a>> {
    grants
        .iter()
        .rfind(|g| g.same_hold(w.invoke) && g.ok.seq < w.invoke.seq)
        .or_else(|| grants.iter().find(|g| g.same_hold(w.invoke)))
}

fn check_writes_inside_holds(grants: &[Grant<'_>], writes: &[Write<'_>], out: &mut Vec<Violation>) {
    for w in writes {
        let who = w.invoke.client.as_deref().unwrap_or("?");
        let Some(g) = writer(grants, w) else {
            out.push(violation(
                Rule::WriteOutsideHold,
                format!(
                    "{who}'s write {:?} was accepted with fencing {:?} / token {:?}, which {who} was never granted on this key",
                    w.invoke.value.as_deref().unwrap_or(""),
                    w.invoke.fencing,
                    w.invoke.token
                ),
                [w.invoke, w.done],
            ));
            continue;
        };
        if w.invoke.seq < g.ok.seq || w.invoke.seq > g.hold_end_seq() {
            let end = g.hold_end.map_or("the end of the history".to_owned(), |e| {
                format!("{} at {:.1} ms", describe_end(e), e.at_ms())
            });
            out.push(violation(
                Rule::WriteOutsideHold,
                format!(
                    "{who}'s write {:?} at {:.1} ms was accepted outside {} (held from {:.1} ms until {end})",
                    w.invoke.value.as_deref().unwrap_or(""),
                    w.invoke.at_ms(),
                    g.name(),
                    g.ok.at_ms(),
                ),
                [Some(g.ok), Some(w.invoke), Some(w.done), g.hold_end]
                    .into_iter()
                    .flatten(),
            ));
        }
    }
}

fn describe_end(r: &Record) -> &'static str {
    if r.kind == Kind::Lost {
        "it learned it lost the lock"
    } else {
        "its release"
    }
}

fn check_write_spans(grants: &[Grant<'_>], writes: &[Write<'_>], out: &mut Vec<Violation>) {
    // (grant index) -> (first write, last write)
    let mut spans: BTreeMap<usize, (Write<'_>, Write<'_>)> = BTreeMap::new();
    for w in writes {
        let Some(g) = writer(grants, w) else { continue };
        let Some(i) = grants.iter().position(|x| std::ptr::eq(x, g)) else {
            continue;
        };
        let span = spans.entry(i).or_insert((*w, *w));
        if w.invoke.seq < span.0.invoke.seq {
            span.0 = *w;
        }
        if w.done.seq > span.1.done.seq {
            span.1 = *w;
        }
    }
    let spans: Vec<_> = spans.into_iter().collect();
    // A stale write is reported once, against the first newer grant it came after.
    let mut stale_reported = std::collections::BTreeSet::new();
    for (n, (i, (a_first, a_last))) in spans.iter().enumerate() {
        for (j, (b_first, b_last)) in &spans[n + 1..] {
            let (a, b) = (&grants[*i], &grants[*j]);
            if a.key != b.key {
                continue;
            }
            if a_first.invoke.seq > b_last.done.seq || b_first.invoke.seq > a_last.done.seq {
                // Disjoint: the earlier span must belong to the earlier grant.
                let (earlier, later) = if a_last.done.seq < b_first.invoke.seq {
                    ((a, a_last), (b, b_first))
                } else {
                    ((b, b_last), (a, a_first))
                };
                let later_granted_first = match (earlier.0.fencing, later.0.fencing) {
                    (Some(e), Some(l)) => l < e,
                    _ => later.0.ok.seq < earlier.0.invoke.seq,
                };
                if later_granted_first && stale_reported.insert(later.1.invoke.seq) {
                    out.push(violation(
                        Rule::StaleWriteAccepted,
                        format!(
                            "{:?} of {} was accepted at {:.1} ms, after {:?} of the newer {} had been accepted at {:.1} ms",
                            later.1.invoke.value.as_deref().unwrap_or(""),
                            later.0.name(),
                            later.1.done.at_ms(),
                            earlier.1.invoke.value.as_deref().unwrap_or(""),
                            earlier.0.name(),
                            earlier.1.done.at_ms(),
                        ),
                        [earlier.0.ok, later.0.ok, earlier.1.done, later.1.invoke, later.1.done],
                    ));
                }
            } else {
                // Name the pair of writes that interleave.
                let (early, late) = if a_first.invoke.seq <= b_first.invoke.seq {
                    ((a, a_last), (b, b_first))
                } else {
                    ((b, b_last), (a, a_first))
                };
                out.push(violation(
                    Rule::OverlappingWrites,
                    format!(
                        "accepted writes of {} ({:.1}–{:.1} ms) and {} ({:.1}–{:.1} ms) overlap: {:?} at {:.1} ms was accepted while the other holder was writing",
                        a.name(),
                        a_first.invoke.at_ms(),
                        a_last.done.at_ms(),
                        b.name(),
                        b_first.invoke.at_ms(),
                        b_last.done.at_ms(),
                        if early.1.done.seq > late.1.invoke.seq {
                            early.1.invoke.value.as_deref().unwrap_or("")
                        } else {
                            late.1.invoke.value.as_deref().unwrap_or("")
                        },
                        early.1.done.at_ms().max(late.1.invoke.at_ms()),
                    ),
                    [a_first.invoke, a_last.done, b_first.invoke, b_last.done],
                ));
            }
        }
    }
}

fn check_fencing(grants: &[Grant<'_>], out: &mut Vec<Violation>) {
    for (n, a) in grants.iter().enumerate() {
        let Some(fa) = a.fencing else { continue };
        for b in &grants[n + 1..] {
            let Some(fb) = b.fencing else { continue };
            if a.key != b.key {
                continue;
            }
            let (first, second, f1, f2) = if a.ok.seq < b.invoke.seq {
                (a, b, fa, fb)
            } else if b.ok.seq < a.invoke.seq {
                (b, a, fb, fa)
            } else {
                // Concurrent windows: the grant order is unknown; the tokens must still differ.
                if fa == fb {
                    out.push(violation(
                        Rule::FencingNotIncreasing,
                        format!(
                            "{} and {} were granted the same fencing token",
                            a.name(),
                            b.client
                        ),
                        [a.ok, b.ok],
                    ));
                }
                continue;
            };
            if f1 >= f2 {
                out.push(violation(
                    Rule::FencingNotIncreasing,
                    format!(
                        "{} (granted by {:.1} ms) came before {}'s grant #{f2} (asked at {:.1} ms), but its token is not smaller",
                        first.name(),
                        first.ok.at_ms(),
                        second.client,
                        second.invoke.at_ms()
                    ),
                    [first.ok, second.invoke, second.ok],
                ));
            }
        }
    }
}

fn check_releases_and_grants(
    records: &[Record],
    ops: &[Operation<'_>],
    grants: &[Grant<'_>],
    options: &CheckOptions,
    end_seq: u64,
    out: &mut Vec<Violation>,
) {
    let releases: Vec<(Operation<'_>, Option<&Grant<'_>>)> = ops
        .iter()
        .filter(|op| op.invoke.op == Some(Op::Release))
        .map(|op| {
            let g = grants
                .iter()
                .rfind(|g| g.same_hold(op.invoke) && g.ok.seq < op.invoke.seq);
            (*op, g)
        })
        .collect();

    // A release that returned true although a later grant had already been made.
    for (op, owner) in &releases {
        let (Some(done), Some(owner)) = (op.done, owner) else {
            continue;
        };
        if done.kind != Kind::Ok || done.released != Some(true) {
            continue;
        }
        if let Some(later) = grants.iter().find(|b| {
            b.key == owner.key
                && !std::ptr::eq(*b, *owner)
                && owner.ok.seq < b.invoke.seq
                && b.ok.seq < op.invoke.seq
        }) {
            out.push(violation(
                Rule::StaleReleaseTookEffect,
                format!(
                    "{}'s release of {} returned true at {:.1} ms, but {} had been granted since ({:.1} ms)",
                    owner.client,
                    owner.name(),
                    done.at_ms(),
                    later.name(),
                    later.ok.at_ms()
                ),
                [owner.ok, later.ok, op.invoke, done],
            ));
        }
    }

    // A grant inside another grant's definite lease.
    let interventions: Vec<&Record> = records
        .iter()
        .filter(|r| {
            (r.kind == Kind::Invoke && r.op == Some(Op::ForceRelease))
                || (r.kind == Kind::FaultStart && r.key.is_some())
        })
        .collect();
    // The first intervention on the key after `from`: it may have ended any grant not yet
    // answered by then, and ends every grant's exclusivity from then on.
    let intervention_after = |key: &str, from: u64| {
        interventions
            .iter()
            .find(|r| r.seq > from && r.key.as_deref() == Some(key))
            .map_or(u64::MAX, |r| r.seq)
    };
    let definite: Vec<(u64, u64)> = grants
        .iter()
        .map(|b| {
            // Seq bound: the hold's end, the first intervention after the acquire was invoked
            // (a grant made before a force-release answered is gone), the end of the history.
            let end_seq = b
                .hold_end_seq()
                .min(end_seq)
                .min(intervention_after(b.key, b.invoke.seq));
            (end_seq, definite_lease_end_us(records, ops, b, options))
        })
        .collect();
    for (bi, b) in grants.iter().enumerate() {
        let (definite_end_seq, definite_end_us) = definite[bi];
        for (ci, c) in grants.iter().enumerate() {
            if bi == ci || b.key != c.key || c.ok.seq <= b.ok.seq {
                continue;
            }
            // Each was granted at some instant of its [invoke, ok] window, at the latest at its
            // ok; both were certainly held together when c answered inside b's definite lease
            // and b answered inside c's (c may have been granted first when c asked before b's
            // answer: then c's own lease must still have been definite at b's answer).
            let (c_end_seq, c_end_us) = definite[ci];
            if c.ok.seq >= definite_end_seq
                || c.ok.at_us >= definite_end_us
                || b.ok.seq >= c_end_seq
                || b.ok.at_us >= c_end_us
            {
                continue;
            }
            let stale = releases.iter().find(|(op, owner)| {
                op.invoke.seq > b.ok.seq
                    && op.invoke.seq < c.ok.seq
                    && op.invoke.key.as_deref() == Some(b.key)
                    && owner.is_none_or(|o| !std::ptr::eq(o, b))
            });
            let (rule, why) = match stale {
                Some((op, _)) => (
                    Rule::StaleReleaseTookEffect,
                    format!(
                        " after {}'s release with a stale token at {:.1} ms",
                        op.invoke.client.as_deref().unwrap_or("?"),
                        op.invoke.at_ms()
                    ),
                ),
                None => (Rule::DoubleGrant, String::new()),
            };
            let mut involved = vec![b.ok, c.invoke, c.ok];
            if let Some((op, _)) = stale {
                involved.push(op.invoke);
            }
            out.push(violation(
                rule,
                format!(
                    "{} was granted at {:.1} ms (asked at {:.1} ms) while {} was still definitely held (until {:.1} ms){why}",
                    c.name(),
                    c.ok.at_ms(),
                    c.invoke.at_ms(),
                    b.name(),
                    (definite_end_us.min(
                        records
                            .get(usize::try_from(definite_end_seq).unwrap_or(usize::MAX))
                            .map_or(u64::MAX, |r| r.at_us)
                    )) as f64
                        / 1000.0,
                ),
                involved,
            ));
        }
    }
}

/// Until when (µs) the coordinator certainly keeps grant `b` by time alone: its TTL from its
/// invoke, pushed out by every renewal that succeeded (a renewal's TTL counts from its own
/// invoke; a watchdog's renewal is recorded with the local deadline it gave).
fn definite_lease_end_us(
    records: &[Record],
    ops: &[Operation<'_>],
    b: &Grant<'_>,
    options: &CheckOptions,
) -> u64 {
    let slack = |ttl: Duration| {
        options
            .lease_slack
            .unwrap_or_else(|| lock_core::drift_margin(ttl))
    };
    let ttl_end = |invoke: &Record, ttl: Option<Duration>| {
        ttl.map_or(u64::MAX, |ttl| {
            invoke
                .at_us
                .saturating_add(micros(ttl))
                .saturating_sub(micros(slack(ttl)))
        })
    };
    let renewed_us = records
        .iter()
        .filter(|r| r.seq > b.ok.seq && b.same_hold(r))
        .filter_map(|r| match (r.kind, r.op) {
            (Kind::Renewed, _) => r.deadline_us,
            (Kind::Invoke, Some(Op::Renew)) => ops
                .iter()
                .find(|op| std::ptr::eq(op.invoke, r))
                .and_then(|op| op.done)
                .filter(|d| d.kind == Kind::Ok)
                .map(|_| ttl_end(r, r.ttl_ms.map(Duration::from_millis).or(b.ttl))),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    ttl_end(b.invoke, b.ttl).max(renewed_us)
}

fn check_final_state(records: &[Record], ops: &[Operation<'_>], out: &mut Vec<Violation>) {
    let finals = final_values(records);
    let mut by_resource: BTreeMap<&str, Vec<Operation<'_>>> = BTreeMap::new();
    for op in ops.iter().filter(|op| op.invoke.op == Some(Op::Write)) {
        if let Some(res) = op.invoke.resource.as_deref() {
            by_resource.entry(res).or_default().push(*op);
        }
    }
    for (resource, writes) in by_resource {
        let acked: Vec<&Operation<'_>> = writes
            .iter()
            .filter(|w| w.outcome() == Some(Kind::Ok))
            .collect();
        if acked.is_empty() {
            continue;
        }
        let Some((final_record, values)) = finals.get(resource) else {
            out.push(violation(
                Rule::AcknowledgedWriteLost,
                format!("{resource} has acknowledged writes but no final state was recorded"),
                acked.iter().filter_map(|w| w.done),
            ));
            continue;
        };
        let value_of = |w: &Operation<'_>| w.invoke.value.clone().unwrap_or_default();
        match final_record.resource_kind.unwrap_or(ResourceKind::Register) {
            ResourceKind::Log => {
                for w in &acked {
                    if !values.contains(&value_of(w)) {
                        out.push(violation(
                            Rule::AcknowledgedWriteLost,
                            format!(
                                "{resource}: acknowledged write {:?} by {} is missing from the final state",
                                value_of(w),
                                w.invoke.client.as_deref().unwrap_or("?")
                            ),
                            [Some(w.invoke), w.done, Some(*final_record)].into_iter().flatten(),
                        ));
                    }
                }
            }
            ResourceKind::Register => {
                // The newest acknowledged write, by fencing token (or by completion order).
                let newest = acked
                    .iter()
                    .max_by_key(|w| (w.invoke.fencing, w.end_seq(u64::MAX)))
                    .copied();
                let Some(newest) = newest else { continue };
                let present = values.last().is_some_and(|v| {
                    writes.iter().any(|w| {
                        matches!(w.outcome(), Some(Kind::Ok | Kind::Unknown) | None)
                            && value_of(w) == *v
                            && (std::ptr::eq(w, newest)
                                || match (w.invoke.fencing, newest.invoke.fencing) {
                                    (Some(a), Some(b)) => a > b,
                                    _ => w.end_seq(u64::MAX) > newest.invoke.seq,
                                })
                    })
                });
                if !present {
                    out.push(violation(
                        Rule::AcknowledgedWriteLost,
                        format!(
                            "{resource}: the final value {:?} is not the newest acknowledged write {:?} (fencing {:?}) nor a newer one",
                            values.last(),
                            value_of(newest),
                            newest.invoke.fencing
                        ),
                        [Some(newest.invoke), newest.done, Some(*final_record)]
                            .into_iter()
                            .flatten(),
                    ));
                }
            }
        }
    }
}

fn check_liveness(
    records: &[Record],
    ops: &[Operation<'_>],
    options: &CheckOptions,
    out: &mut Vec<Violation>,
) {
    let mut open: BTreeMap<u64, &Record> = BTreeMap::new();
    let mut last_heal: Option<&Record> = None;
    for r in records {
        match (r.kind, r.fault_id) {
            (Kind::FaultStart, Some(id)) => {
                open.insert(id, r);
            }
            (Kind::FaultEnd, Some(id)) => {
                open.remove(&id);
                last_heal = Some(r);
            }
            _ => {}
        }
    }
    for start in open.values() {
        out.push(violation(
            Rule::Liveness,
            format!(
                "fault {:?} on {} never healed: liveness cannot be judged",
                start.fault.as_deref().unwrap_or("?"),
                start.target.as_deref().unwrap_or("everything")
            ),
            [*start],
        ));
    }
    let heal_seq = last_heal.map_or(0, |r| r.seq);
    let heal_us = last_heal.map_or(0, |r| r.at_us);
    let ttl = options.ttl.or_else(|| {
        ops.iter()
            .filter(|op| op.invoke.op == Some(Op::Acquire))
            .filter_map(|op| op.invoke.ttl_ms)
            .max()
            .map(Duration::from_millis)
    });

    // client -> (first try after the heal, its acquires that could count)
    let mut tries: BTreeMap<&str, (u64, &Record, Vec<Operation<'_>>)> = BTreeMap::new();
    for op in ops.iter().filter(|op| op.invoke.op == Some(Op::Acquire)) {
        let pending_at_heal = op.done.is_none_or(|d| d.seq > heal_seq);
        if op.invoke.seq < heal_seq && !pending_at_heal {
            continue;
        }
        let client = op.invoke.client.as_deref().unwrap_or("?");
        let from = op.invoke.at_us.max(heal_us);
        let entry = tries.entry(client).or_insert((from, op.invoke, Vec::new()));
        if from < entry.0 {
            entry.0 = from;
            entry.1 = op.invoke;
        }
        entry.2.push(*op);
    }
    if last_heal.is_some() && tries.is_empty() {
        out.push(violation(
            Rule::Liveness,
            "nobody tried to acquire after the last fault healed: liveness was not exercised"
                .to_owned(),
            last_heal,
        ));
    }
    // Nobody tried at all (so no TTL is known either): reported above.
    let Some(ttl) = ttl else { return };
    let allowed = micros(ttl + options.liveness_margin);
    for (client, (from, first, acquires)) in tries {
        let granted = acquires
            .iter()
            .filter_map(|op| op.done)
            .filter(|d| d.kind == Kind::Ok && d.granted == Some(true) && d.seq > heal_seq)
            .map(|d| d.at_us)
            .min();
        match granted {
            Some(at) if at <= from.saturating_add(allowed) => {}
            Some(at) => out.push(violation(
                Rule::Liveness,
                format!(
                    "{client} tried from {:.1} ms but was granted only at {:.1} ms (allowed: ttl {ttl:?} + margin {:?})",
                    from as f64 / 1000.0,
                    at as f64 / 1000.0,
                    options.liveness_margin
                ),
                [first],
            )),
            None => out.push(violation(
                Rule::Liveness,
                format!(
                    "{client} tried from {:.1} ms and was never granted the lock again",
                    from as f64 / 1000.0
                ),
                [first],
            )),
        }
    }
}

/// What the mutex model found on one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelVerdict {
    /// Some order of the operations, each taking effect inside its window, fits a single-holder
    /// mutex with leases.
    Linearizable,
    /// No such order exists; `stuck` is the first definite operation (by completion) that the
    /// deepest search could not place, with its records.
    NotLinearizable {
        /// Why, for a person.
        message: String,
        /// The `seq` of the records involved.
        records: Vec<u64>,
    },
    /// The search hit [`MODEL_SEARCH_CAP`] states before deciding.
    Inconclusive,
}

/// The mutex model's result for one key, with the size of its search.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelReport {
    /// The lock key.
    pub key: String,
    /// Operations the model considered (definite and indeterminate).
    pub operations: usize,
    /// Search states explored (each memoised, so no state twice).
    pub states: usize,
    /// The verdict.
    pub verdict: ModelVerdict,
    /// Wall time the search took.
    pub elapsed: Duration,
}

/// States the mutex model explores per key before it answers [`ModelVerdict::Inconclusive`].
pub const MODEL_SEARCH_CAP: usize = 200_000;

/// What one operation does to the model's state (`holder`: 0 free, 1 a grant nobody was told
/// of, `2 + g` grant `g`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    /// A definite grant: the key must be free (or its holder's definite lease over) → `g`.
    Grant(u32),
    /// `try_acquire` answered busy: somebody holds the key.
    Busy,
    /// A release that returned `true`: `g` must be the holder → free.
    Release(u32),
    /// A release of `g` that returned `false`: `g` was not the holder, or its lease had ended.
    NotReleased(u32),
    /// A release of `g` that failed or whose outcome is unknown: may have freed the key if `g`
    /// held it.
    MaybeRelease(u32),
    /// An acquire without a definite grant: may have granted the key to nobody we know of.
    Ghost,
    /// A force-release answered ok, an expiry forced from outside: → free.
    Free,
    /// A force-release with another outcome.
    MaybeFree,
}

/// A moment of the history: microseconds, then the `seq` of the record taken then (so records
/// taken in the same microsecond keep their order); expiries are at seq 0 of their microsecond.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Point(u64, u64);

impl Point {
    const MIN: Point = Point(0, 0);
    const MAX: Point = Point(u64::MAX, u64::MAX);

    fn at_us(us: u64) -> Point {
        Point(us, 0)
    }
}

fn point(r: &Record) -> Point {
    Point(r.at_us, r.seq)
}

#[derive(Clone, Copy, Debug)]
struct ModelOp<'a> {
    invoke: Point,
    /// [`Point::MAX`] for indeterminate operations: they may take effect at any time after
    /// invoke, or never.
    ok: Point,
    effect: Effect,
    records: [Option<&'a Record>; 2],
}

impl ModelOp<'_> {
    fn optional(&self) -> bool {
        matches!(
            self.effect,
            Effect::MaybeRelease(_) | Effect::Ghost | Effect::MaybeFree
        )
    }
}

/// Checks each key's operations against a single-holder mutex whose grants may end at their
/// definite-lease end (Wing & Gong search with memoised states, bounded by
/// [`MODEL_SEARCH_CAP`]). Acquires answered busy must find the key held; acquires and releases
/// that failed, timed out or are unknown may or may not have taken effect, at any point after
/// their invoke. Renewals only extend definite leases; writes are judged by the other rules.
pub fn check_mutex_model(records: &[Record], options: &CheckOptions) -> Vec<ModelReport> {
    let mut sink = Vec::new();
    let ops = pair_operations(records, &mut sink);
    let grants = grants(records, &ops);
    let mut keys: BTreeMap<&str, Vec<ModelOp<'_>>> = BTreeMap::new();
    // Earliest moment each grant may have ended by itself: its definite lease's time bound,
    // or its holder learning it was lost.
    let expiry: Vec<u64> = grants
        .iter()
        .map(|g| {
            let lost = records
                .iter()
                .find(|r| r.seq > g.ok.seq && r.kind == Kind::Lost && g.same_hold(r))
                .map_or(u64::MAX, |r| r.at_us);
            definite_lease_end_us(records, &ops, g, options).min(lost)
        })
        .collect();
    let grant_of = |op: &Operation<'_>| {
        grants
            .iter()
            .rposition(|g| g.same_hold(op.invoke) && g.ok.seq < op.invoke.seq)
            .and_then(|i| u32::try_from(i).ok())
    };
    for op in &ops {
        let Some(key) = op.invoke.key.as_deref() else {
            continue;
        };
        let done = op.done;
        let answered = done.filter(|d| d.kind == Kind::Ok);
        let effect = match op.invoke.op {
            Some(Op::Acquire) => match answered.and_then(|d| d.granted) {
                Some(true) => match grants
                    .iter()
                    .position(|g| std::ptr::eq(g.ok, done.unwrap_or(op.invoke)))
                {
                    Some(i) => u32::try_from(i).ok().map(Effect::Grant),
                    None => None,
                },
                Some(false) => Some(Effect::Busy),
                None => Some(Effect::Ghost),
            },
            Some(Op::Release) => grant_of(op).map(|g| match answered.and_then(|d| d.released) {
                Some(true) => Effect::Release(g),
                Some(false) => Effect::NotReleased(g),
                None => Effect::MaybeRelease(g),
            }),
            Some(Op::ForceRelease) => Some(if answered.is_some() {
                Effect::Free
            } else {
                Effect::MaybeFree
            }),
            _ => None,
        };
        let Some(effect) = effect else { continue };
        let mut m = ModelOp {
            invoke: point(op.invoke),
            ok: done.map_or(Point::MAX, point),
            effect,
            records: [Some(op.invoke), done],
        };
        if m.optional() {
            m.ok = Point::MAX;
        }
        keys.entry(key).or_default().push(m);
    }
    // Expiries forced from outside (History::expire) take effect when recorded.
    for r in records
        .iter()
        .filter(|r| r.kind == Kind::FaultStart && r.key.is_some())
    {
        if let Some(key) = r.key.as_deref() {
            keys.entry(key).or_default().push(ModelOp {
                invoke: point(r),
                ok: point(r),
                effect: Effect::Free,
                records: [Some(r), None],
            });
        }
    }
    keys.into_iter()
        .map(|(key, mut ops)| {
            ops.sort_by_key(|o| (o.invoke, o.ok));
            let started = std::time::Instant::now();
            let (states, verdict) = search_mutex(&ops, &expiry, &grants);
            ModelReport {
                key: key.to_owned(),
                operations: ops.len(),
                states,
                verdict,
                elapsed: started.elapsed(),
            }
        })
        .collect()
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct ModelState {
    done: Vec<u64>,
    holder: u32,
    /// The latest linearization point so far: later operations take effect no earlier.
    now: Point,
}

fn is_done(done: &[u64], i: usize) -> bool {
    done[i / 64] & (1 << (i % 64)) != 0
}

fn search_mutex(
    ops: &[ModelOp<'_>],
    expiry: &[u64],
    grants: &[Grant<'_>],
) -> (usize, ModelVerdict) {
    let mandatory = ops.iter().filter(|o| !o.optional()).count();
    let start = ModelState {
        done: vec![0; ops.len().div_ceil(64)],
        holder: 0,
        now: Point::MIN,
    };
    let mut seen: std::collections::HashSet<ModelState> = std::collections::HashSet::new();
    seen.insert(start.clone());
    let mut stack = vec![(start, 0usize)];
    // The deepest state (most definite operations placed), for the report.
    let mut deepest: (usize, Option<ModelState>) = (0, None);
    while let Some((state, placed)) = stack.pop() {
        if placed == mandatory {
            return (seen.len(), ModelVerdict::Linearizable);
        }
        if placed >= deepest.0 {
            deepest = (placed, Some(state.clone()));
        }
        if seen.len() >= MODEL_SEARCH_CAP {
            return (seen.len(), ModelVerdict::Inconclusive);
        }
        // The two earliest completions among the definite operations not yet placed: nothing
        // can take effect after them.
        let (mut min1, mut min1_at, mut min2) = (Point::MAX, usize::MAX, Point::MAX);
        for (i, o) in ops.iter().enumerate() {
            if !is_done(&state.done, i) && o.ok < min2 {
                if o.ok < min1 {
                    (min2, min1, min1_at) = (min1, o.ok, i);
                } else {
                    min2 = o.ok;
                }
            }
        }
        let mut children = Vec::new();
        for (i, o) in ops.iter().enumerate() {
            if o.invoke > min1 {
                break;
            }
            if is_done(&state.done, i) {
                continue;
            }
            let bound = if i == min1_at { min2 } else { min1 }.min(o.ok);
            let from = state.now.max(o.invoke);
            let expired = |holder: u32| match holder {
                0 => Some(from),
                1 => Some(from),
                g => expiry
                    .get((g - 2) as usize)
                    .map(|e| from.max(Point::at_us(*e))),
            };
            let next = match o.effect {
                Effect::Grant(g) => expired(state.holder).map(|t| (g + 2, t)),
                Effect::Busy => (state.holder != 0).then_some((state.holder, from)),
                Effect::Release(g) => (state.holder == g + 2).then_some((0, from)),
                Effect::NotReleased(g) if state.holder == g + 2 => {
                    expired(state.holder).map(|t| (0, t))
                }
                Effect::NotReleased(_) => Some((state.holder, from)),
                Effect::MaybeRelease(g) => (state.holder == g + 2).then_some((0, from)),
                Effect::Ghost => (state.holder == 0).then_some((1, from)),
                Effect::Free => Some((0, from)),
                Effect::MaybeFree => (state.holder != 0).then_some((0, from)),
            };
            let Some((holder, at)) = next else { continue };
            if at > bound {
                continue;
            }
            let mut done = state.done.clone();
            done[i / 64] |= 1 << (i % 64);
            let child = ModelState {
                done,
                holder,
                now: at,
            };
            if seen.insert(child.clone()) {
                children.push((child, placed + usize::from(!o.optional())));
            }
        }
        // Explore the earliest-invoked candidate first.
        stack.extend(children.into_iter().rev());
    }
    let Some(state) = deepest.1 else {
        return (seen.len(), ModelVerdict::Linearizable);
    };
    // The first definite operation (by completion) the deepest order could not place.
    let stuck = ops
        .iter()
        .enumerate()
        .filter(|(i, o)| !o.optional() && !is_done(&state.done, *i))
        .min_by_key(|(_, o)| o.ok)
        .map(|(_, o)| *o);
    let holder = match state.holder {
        0 => "free".to_owned(),
        1 => "held by an unanswered acquire".to_owned(),
        g => grants
            .get((g - 2) as usize)
            .map_or("held".to_owned(), |g| format!("held by {}", g.name())),
    };
    let (message, records) = match stuck {
        Some(o) => {
            let what = match o.effect {
                Effect::Grant(g) => grants
                    .get(g as usize)
                    .map_or("a grant".to_owned(), |g| format!("{} (granted)", g.name())),
                Effect::Busy => "an acquire answered busy".to_owned(),
                Effect::Release(g) => grants
                    .get(g as usize)
                    .map_or("a release that returned true".to_owned(), |g| {
                        format!("the release of {} that returned true", g.name())
                    }),
                Effect::NotReleased(g) => grants
                    .get(g as usize)
                    .map_or("a release that returned false".to_owned(), |g| {
                        format!("the release of {} that returned false", g.name())
                    }),
                _ => "an intervention".to_owned(),
            };
            (
                format!(
                    "no single-holder order of the operations fits: {what} ({:.1}–{:.1} ms) cannot take effect after the {} operations before it, with the key {holder}",
                    o.invoke.0 as f64 / 1000.0,
                    o.ok.0 as f64 / 1000.0,
                    deepest.0
                ),
                o.records.iter().flatten().map(|r| r.seq).collect(),
            )
        }
        None => (
            "no single-holder order of the operations fits".to_owned(),
            Vec::new(),
        ),
    };
    (
        seen.len(),
        ModelVerdict::NotLinearizable { message, records },
    )
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn violation<'a>(
    rule: Rule,
    message: String,
    records: impl IntoIterator<Item = &'a Record>,
) -> Violation {
    let mut seqs: Vec<u64> = records.into_iter().map(|r| r.seq).collect();
    seqs.sort_unstable();
    seqs.dedup();
    Violation {
        rule,
        message,
        records: seqs,
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, time::Duration};

    use lock_core::{FencingToken, LockKey, TokenDigest};
    use tokio::time::{Instant, advance};

    use super::*;
    use crate::drill::history::{ClientRecorder, History, Hold};

    const TTL: Duration = Duration::from_millis(100);

    fn key() -> LockKey {
        LockKey::new("checker/k").unwrap()
    }

    fn hold(fencing: u64, token: &str) -> Hold {
        Hold {
            key: key(),
            token: TokenDigest::of(token.as_bytes()),
            fencing: Some(FencingToken(fencing)),
            ttl: TTL,
        }
    }

    /// Moves the (paused) clock to `ms` after `start`.
    async fn at(start: Instant, ms: u64) {
        let target = start + Duration::from_millis(ms);
        let now = Instant::now();
        assert!(target >= now, "scenario times must increase ({ms} ms)");
        advance(target - now).await;
    }

    /// What to break in the scenario.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Break {
        Nothing,
        /// c1 writes after it invoked its release, and the write is accepted.
        WriteAfterRelease,
        /// c2's stale write after its pause is accepted (no fencing check); c2 had written
        /// before its pause too, so its writes straddle c3's.
        StaleWriteAccepted,
        /// As `StaleWriteAccepted`, but c2 had not written before its pause.
        OnlyTheLateStaleWriteAccepted,
        /// c1's second grant carries a token below c3's earlier one.
        FencingGoesBack,
        /// c2's release after its lease was taken over returns true.
        StaleReleaseReturnsTrue,
        /// The register's final value is an older acknowledged write.
        FinalStateLosesWrite,
        /// No final state is recorded.
        NoFinalState,
        /// After the heal c2 tries and is never granted.
        NoLiveness,
        /// The pause is never healed.
        FaultNeverHealed,
    }

    /// c1 holds and writes; c2 acquires and is paused past its TTL; c3 takes over and writes; c2
    /// resumes, writes (rejected), learns it lost, releases (false); after the heal every client
    /// acquires again. A register resource.
    async fn scenario(b: Break) -> Vec<Record> {
        let h = History::new("checker_scenario");
        let start = h.start();
        let (c1, c2, c3) = (h.client("c1"), h.client("c2"), h.client("c3"));
        let k = key();

        let op = c1.acquire(&k, TTL);
        at(start, 1).await;
        op.granted(hold(1, "t1"));
        at(start, 2).await;
        c1.write(hold(1, "t1"), "reg", "c1#1").ok();
        at(start, 3).await;
        let rel = c1.release(hold(1, "t1"));
        if b == Break::WriteAfterRelease {
            c1.write(hold(1, "t1"), "reg", "c1#1-late").ok();
        }
        at(start, 4).await;
        rel.released(true);

        at(start, 5).await;
        let op = c2.acquire(&k, TTL);
        at(start, 6).await;
        op.granted(hold(2, "t2"));
        if b != Break::OnlyTheLateStaleWriteAccepted {
            at(start, 7).await;
            c2.write(hold(2, "t2"), "reg", "c2#2").ok();
        }
        let pause = h.fault("paused", Some("c2"));
        at(start, 10).await;
        let waiting = c3.acquire(&k, TTL);
        at(start, 110).await;
        waiting.granted(hold(3, "t3"));
        at(start, 111).await;
        c3.write(hold(3, "t3"), "reg", "c3#3").ok();
        at(start, 112).await;
        c3.release(hold(3, "t3")).released(true);

        at(start, 130).await;
        if b == Break::FaultNeverHealed {
            std::mem::forget(pause);
        } else {
            pause.heal();
        }
        at(start, 131).await;
        let w = c2.write(hold(2, "t2"), "reg", "c2#2-late");
        if matches!(
            b,
            Break::StaleWriteAccepted | Break::OnlyTheLateStaleWriteAccepted
        ) {
            w.ok();
        } else {
            w.rejected(Some(FencingToken(3)));
        }
        at(start, 132).await;
        c2.lost(hold(2, "t2"), "local deadline passed");
        at(start, 133).await;
        c2.release(hold(2, "t2"))
            .released(b == Break::StaleReleaseReturnsTrue);

        // After the heal: everyone acquires again.
        at(start, 140).await;
        let second = if b == Break::FencingGoesBack { 2 } else { 4 };
        let op = c1.acquire(&k, TTL);
        at(start, 141).await;
        op.granted(hold(second, "t4"));
        at(start, 142).await;
        c1.release(hold(second, "t4")).released(true);
        at(start, 150).await;
        let op = c2.acquire(&k, TTL);
        if b == Break::NoLiveness {
            at(start, 5_000).await;
            op.fail("timed out");
        } else {
            at(start, 151).await;
            op.granted(hold(5, "t5"));
            at(start, 152).await;
            c2.write(hold(5, "t5"), "reg", "c2#5").ok();
            at(start, 153).await;
            c2.release(hold(5, "t5")).released(true);
        }
        at(start, 5_001).await;
        let op = c3.acquire(&k, TTL);
        at(start, 5_002).await;
        op.granted(hold(6, "t6"));
        c3.release(hold(6, "t6")).released(true);

        let last = match b {
            Break::FinalStateLosesWrite => "c3#3",
            Break::NoLiveness => "c3#3",
            _ => "c2#5",
        };
        if b != Break::NoFinalState {
            h.final_state("reg", ResourceKind::Register, vec![last.to_owned()]);
        }
        h.snapshot()
    }

    fn rules(records: &[Record]) -> BTreeSet<Rule> {
        let violations = check(records, &CheckOptions::default());
        for v in &violations {
            eprintln!("{v}");
        }
        violations.iter().map(|v| v.rule).collect()
    }

    /// A grant while another is held, a release of somebody else's grant: the mutex model
    /// rejects these histories too.
    fn unsafe_grant(rule: Rule) -> BTreeSet<Rule> {
        BTreeSet::from([rule, Rule::NotLinearizable])
    }

    #[tokio::test(start_paused = true)]
    async fn a_clean_history_passes() {
        assert_eq!(rules(&scenario(Break::Nothing).await), BTreeSet::new());
    }

    #[tokio::test(start_paused = true)]
    async fn each_broken_rule_is_reported() {
        for (b, rule) in [
            (Break::WriteAfterRelease, Rule::WriteOutsideHold),
            (Break::StaleWriteAccepted, Rule::OverlappingWrites),
            (
                Break::OnlyTheLateStaleWriteAccepted,
                Rule::StaleWriteAccepted,
            ),
            (Break::FencingGoesBack, Rule::FencingNotIncreasing),
            (Break::StaleReleaseReturnsTrue, Rule::StaleReleaseTookEffect),
            (Break::FinalStateLosesWrite, Rule::AcknowledgedWriteLost),
            (Break::NoFinalState, Rule::AcknowledgedWriteLost),
            (Break::NoLiveness, Rule::Liveness),
            (Break::FaultNeverHealed, Rule::Liveness),
        ] {
            let expected = if rule == Rule::StaleReleaseTookEffect {
                unsafe_grant(rule)
            } else {
                BTreeSet::from([rule])
            };
            assert_eq!(
                rules(&scenario(b).await),
                expected,
                "breaking {b:?} must be reported as exactly {rule:?}"
            );
        }
    }

    /// A stale release that deletes the newer holder's lock lets a third client in early; a grant
    /// inside a live lease without such a release is a double grant.
    #[tokio::test(start_paused = true)]
    async fn stale_release_ending_a_newer_hold_and_double_grants_are_reported() {
        for stale_release in [true, false] {
            let h = History::new("grants");
            let start = h.start();
            let (a, b, c) = (h.client("a"), h.client("b"), h.client("c"));
            let k = key();
            let op = a.acquire(&k, TTL);
            op.granted(hold(1, "a"));
            // a's lease runs out; b is granted.
            at(start, 200).await;
            let op = b.acquire(&k, TTL);
            at(start, 201).await;
            op.granted(hold(2, "b"));
            at(start, 210).await;
            if stale_release {
                // a's stale release is (wrongly) applied to b's lock.
                a.release(hold(1, "a")).released(false);
            }
            at(start, 220).await;
            let op = c.acquire(&k, TTL);
            at(start, 221).await;
            op.granted(hold(3, "c"));
            c.release(hold(3, "c")).released(true);
            let expected = if stale_release {
                Rule::StaleReleaseTookEffect
            } else {
                Rule::DoubleGrant
            };
            assert_eq!(rules(&h.snapshot()), unsafe_grant(expected));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn log_resources_must_keep_every_acknowledged_write() {
        for keep_all in [true, false] {
            let h = History::new("log");
            let start = h.start();
            let c = h.client("c");
            let k = key();
            for (n, name) in [(1u64, "t1"), (2, "t2")] {
                let op = c.acquire(&k, TTL);
                op.granted(hold(n, name));
                c.write(hold(n, name), "log", format!("v{n}")).ok();
                c.release(hold(n, name)).released(true);
                at(start, 10 * n).await;
            }
            let values = if keep_all {
                vec!["v1", "v2"]
            } else {
                vec!["v2"]
            };
            h.final_state(
                "log",
                ResourceKind::Log,
                values.into_iter().map(str::to_owned).collect(),
            );
            let expected = if keep_all {
                BTreeSet::new()
            } else {
                BTreeSet::from([Rule::AcknowledgedWriteLost])
            };
            assert_eq!(rules(&h.snapshot()), expected);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn unknown_outcomes_are_judged_by_the_final_state() {
        // An acquire with unknown outcome is no grant; an unknown write counts as accepted only
        // when its value is in the final state — here it is, and it overlaps nothing.
        let h = History::new("unknown");
        let c = h.client("c");
        let k = key();
        c.acquire(&k, TTL).unknown("reply lost");
        let op = c.acquire(&k, TTL);
        op.granted(hold(2, "t2"));
        c.write(hold(2, "t2"), "reg", "v2").unknown("reply lost");
        c.release(hold(2, "t2")).released(true);
        h.final_state("reg", ResourceKind::Register, vec!["v2".to_owned()]);
        assert_eq!(rules(&h.snapshot()), BTreeSet::new());
        // A dropped operation is recorded as unknown, not forgotten.
        drop(c.acquire(&k, TTL));
        assert_eq!(h.snapshot().last().map(|r| r.kind), Some(Kind::Unknown));
    }

    /// `a` is granted at 1 ms; `c` asks at `c_invoke` and is answered at `c_ok`; `a` releases at
    /// 300 ms. `between` runs at 10 ms (renewals, interventions).
    async fn two_grants(
        c_invoke: u64,
        c_ok: u64,
        between: impl FnOnce(&History, &ClientRecorder),
    ) -> Vec<Record> {
        let h = History::new("two_grants");
        let start = h.start();
        let (a, c) = (h.client("a"), h.client("c"));
        let k = key();
        let op = a.acquire(&k, TTL);
        at(start, 1).await;
        op.granted(hold(1, "a"));
        at(start, 10).await;
        between(&h, &a);
        at(start, c_invoke).await;
        let op = c.acquire(&k, TTL);
        at(start, c_ok).await;
        op.granted(hold(2, "c"));
        at(start, 300).await;
        a.release(hold(1, "a")).released(false);
        c.release(hold(2, "c")).released(true);
        h.snapshot()
    }

    #[tokio::test(start_paused = true)]
    async fn grants_whose_windows_overlap_are_compared() {
        // a and c both ask, then both are answered "granted": at a's answer c was asked but
        // maybe not yet granted; at c's answer both were certainly held.
        let h = History::new("overlap");
        let start = h.start();
        let (a, c) = (h.client("a"), h.client("c"));
        let k = key();
        let op_a = a.acquire(&k, TTL);
        at(start, 1).await;
        let op_c = c.acquire(&k, TTL);
        at(start, 2).await;
        op_a.granted(hold(1, "a"));
        at(start, 3).await;
        op_c.granted(hold(2, "c"));
        a.release(hold(1, "a")).released(true);
        c.release(hold(2, "c")).released(true);
        assert_eq!(rules(&h.snapshot()), unsafe_grant(Rule::DoubleGrant));
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_for_a_grant_that_expired_first_is_no_double_grant() {
        // c asks at 0 and may have been granted at once; its lease (TTL from 0) ended by 94 ms,
        // a was granted by 95 ms, c's answer arrives late at 120 ms. Both may never have been
        // held together; they still must not share a fencing token.
        for same_token in [false, true] {
            let h = History::new("late_answer");
            let start = h.start();
            let (a, c) = (h.client("a"), h.client("c"));
            let k = key();
            let op_c = c.acquire(&k, TTL);
            at(start, 50).await;
            let op_a = a.acquire(&k, TTL);
            at(start, 95).await;
            op_a.granted(hold(2, "a"));
            at(start, 120).await;
            let c_fencing = if same_token { 2 } else { 1 };
            op_c.granted(hold(c_fencing, "c"));
            c.release(hold(c_fencing, "c")).released(false);
            a.release(hold(2, "a")).released(true);
            let expected = if same_token {
                BTreeSet::from([Rule::FencingNotIncreasing])
            } else {
                BTreeSet::new()
            };
            assert_eq!(rules(&h.snapshot()), expected, "same token: {same_token}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_extend_the_definite_lease() {
        // Without a renewal a's lease is definite until 94 ms: c's grant at 151 ms is fine.
        assert_eq!(
            rules(&two_grants(150, 151, |_, _| {}).await),
            BTreeSet::new()
        );
        // A watchdog's renewal recorded with its local deadline (250 ms).
        let watchdog = two_grants(150, 151, |h, a| {
            a.renewed(hold(1, "a"), h.start() + Duration::from_millis(250), 1);
        })
        .await;
        assert_eq!(rules(&watchdog), unsafe_grant(Rule::DoubleGrant));
        // A direct renewal invoked at 10 ms: definite until 10 + 100 − slack = 104 ms.
        assert_eq!(
            rules(&two_grants(100, 101, |_, _| {}).await),
            BTreeSet::new()
        );
        let direct = two_grants(100, 101, |_, a| a.renew(hold(1, "a"), TTL).ok()).await;
        assert_eq!(rules(&direct), unsafe_grant(Rule::DoubleGrant));
        // A refused renewal extends nothing.
        let refused = two_grants(100, 101, |_, a| {
            a.renew(hold(1, "a"), TTL).fail("not held");
        })
        .await;
        assert_eq!(rules(&refused), BTreeSet::new());
        // Another holder's renewal does not extend a's lease.
        let other = two_grants(150, 151, |h, _| {
            h.client("b")
                .renewed(hold(1, "a"), h.start() + Duration::from_millis(250), 1);
        })
        .await;
        assert_eq!(rules(&other), BTreeSet::new());
    }

    #[tokio::test(start_paused = true)]
    async fn force_release_and_expire_end_the_definite_lease() {
        // c granted at 21 ms inside a's lease: a double grant unless something ended a's hold.
        assert_eq!(
            rules(&two_grants(20, 21, |_, _| {}).await),
            unsafe_grant(Rule::DoubleGrant)
        );
        let forced = two_grants(20, 21, |h, _| {
            h.client("operator").force_release(&key()).ok();
        })
        .await;
        assert_eq!(rules(&forced), BTreeSet::new());
        let expired = two_grants(20, 21, |h, _| h.expire(&key(), "force-expired")).await;
        assert_eq!(rules(&expired), BTreeSet::new());
        // An intervention on another key changes nothing.
        let elsewhere = two_grants(20, 21, |h, _| {
            h.expire(&LockKey::new("checker/other").unwrap(), "force-expired");
        })
        .await;
        assert_eq!(rules(&elsewhere), unsafe_grant(Rule::DoubleGrant));
    }

    #[tokio::test(start_paused = true)]
    async fn an_intervention_before_the_answer_may_have_ended_the_grant() {
        // The force-release ran between a's invoke and a's answer: a's grant may already be
        // gone, so c's grant right after is no double grant.
        let h = History::new("intervention_in_window");
        let start = h.start();
        let (a, c) = (h.client("a"), h.client("c"));
        let k = key();
        let op = a.acquire(&k, TTL);
        at(start, 1).await;
        h.client("operator").force_release(&k).ok();
        at(start, 2).await;
        op.granted(hold(1, "a"));
        at(start, 3).await;
        let op = c.acquire(&k, TTL);
        op.granted(hold(2, "c"));
        c.release(hold(2, "c")).released(true);
        assert_eq!(rules(&h.snapshot()), BTreeSet::new());
    }

    #[tokio::test(start_paused = true)]
    async fn writes_with_a_token_never_granted_are_outside_any_hold() {
        let h = History::new("never_granted");
        let c = h.client("c");
        c.write(hold(9, "never"), "log", "v").ok();
        h.final_state("log", ResourceKind::Log, vec!["v".to_owned()]);
        assert_eq!(
            rules(&h.snapshot()),
            BTreeSet::from([Rule::WriteOutsideHold])
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stale_writes_are_found_without_fencing_tokens() {
        // No fencing tokens: the grant order decides. a's grant (expired by 94 ms) writes after
        // b's newer grant wrote.
        let unfenced = |token: &str| Hold {
            fencing: None,
            ..hold(0, token)
        };
        let h = History::new("unfenced");
        let start = h.start();
        let (a, b) = (h.client("a"), h.client("b"));
        let k = key();
        let op = a.acquire(&k, TTL);
        op.granted(unfenced("a"));
        at(start, 150).await;
        let op = b.acquire(&k, TTL);
        op.granted(unfenced("b"));
        b.write(unfenced("b"), "log", "b1").ok();
        b.release(unfenced("b")).released(true);
        at(start, 160).await;
        a.write(unfenced("a"), "log", "a1").ok();
        a.release(unfenced("a")).released(false);
        h.final_state(
            "log",
            ResourceKind::Log,
            vec!["b1".to_owned(), "a1".to_owned()],
        );
        assert_eq!(
            rules(&h.snapshot()),
            BTreeSet::from([Rule::StaleWriteAccepted])
        );
    }

    #[tokio::test(start_paused = true)]
    async fn liveness_needs_a_timely_grant_and_someone_trying() {
        for late in [true, false] {
            let h = History::new("liveness");
            let start = h.start();
            let c = h.client("c");
            let k = key();
            h.fault("paused", None).heal();
            if late {
                at(start, 10).await;
                let op = c.acquire(&k, TTL);
                // ttl 100 ms + margin 2 s after the try: 2.2 s is too late.
                at(start, 2_210).await;
                op.granted(hold(1, "c"));
                c.release(hold(1, "c")).released(true);
            }
            let violations = check(&h.snapshot(), &CheckOptions::default());
            assert_eq!(
                violations.iter().map(|v| v.rule).collect::<Vec<_>>(),
                vec![Rule::Liveness],
                "late: {late}: {violations:?}"
            );
            let expected = if late {
                "granted only at"
            } else {
                "nobody tried"
            };
            assert!(violations[0].message.contains(expected), "{violations:?}");
        }
    }

    fn model(records: &[Record]) -> Vec<ModelVerdict> {
        check_mutex_model(records, &CheckOptions::default())
            .into_iter()
            .map(|r| r.verdict)
            .collect()
    }

    fn not_linearizable(verdicts: &[ModelVerdict]) -> bool {
        matches!(verdicts, [ModelVerdict::NotLinearizable { .. }])
    }

    #[tokio::test(start_paused = true)]
    async fn the_mutex_model_accepts_a_concurrent_linearizable_history() {
        // a and b ask together; a is granted, c finds the key busy, a releases, then b's
        // answer arrives: b's grant took effect after a's release, inside its window.
        let h = History::new("model_ok");
        let start = h.start();
        let (a, b, c) = (h.client("a"), h.client("b"), h.client("c"));
        let k = key();
        let op_a = a.acquire(&k, TTL);
        let op_b = b.acquire(&k, TTL);
        at(start, 1).await;
        op_a.granted(hold(1, "a"));
        let op_c = c.acquire(&k, TTL);
        at(start, 2).await;
        op_c.busy();
        let rel = a.release(hold(1, "a"));
        at(start, 3).await;
        rel.released(true);
        at(start, 4).await;
        op_b.granted(hold(2, "b"));
        b.release(hold(2, "b")).released(true);
        assert_eq!(model(&h.snapshot()), vec![ModelVerdict::Linearizable]);
        // (c never got the key: the liveness rule, not the model, says so.)
        assert_eq!(rules(&h.snapshot()), BTreeSet::from([Rule::Liveness]));
    }

    #[tokio::test(start_paused = true)]
    async fn the_mutex_model_rejects_two_overlapping_definite_grants() {
        let h = History::new("model_double");
        let start = h.start();
        let (a, b) = (h.client("a"), h.client("b"));
        let k = key();
        let op_a = a.acquire(&k, TTL);
        at(start, 1).await;
        let op_b = b.acquire(&k, TTL);
        at(start, 2).await;
        op_a.granted(hold(1, "a"));
        op_b.granted(hold(2, "b"));
        at(start, 10).await;
        b.release(hold(2, "b")).released(true);
        a.release(hold(1, "a")).released(false);
        assert!(not_linearizable(&model(&h.snapshot())));
        // Once a's lease ran out (TTL from its invoke, less the drift margin) b may have it.
        let h = History::new("model_expired");
        let start = h.start();
        let op_a = h.client("a").acquire(&k, TTL);
        at(start, 1).await;
        op_a.granted(hold(1, "a"));
        at(start, 95).await;
        let op_b = h.client("b").acquire(&k, TTL);
        at(start, 96).await;
        op_b.granted(hold(2, "b"));
        assert_eq!(model(&h.snapshot()), vec![ModelVerdict::Linearizable]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_mutex_model_rejects_a_release_of_a_free_lock() {
        // a's second release returns true although the first one freed the key. No later grant
        // exists, so the older rules have nothing to compare it with.
        let h = History::new("model_free_release");
        let start = h.start();
        let a = h.client("a");
        let k = key();
        let op = a.acquire(&k, TTL);
        op.granted(hold(1, "a"));
        at(start, 1).await;
        a.release(hold(1, "a")).released(true);
        at(start, 2).await;
        a.release(hold(1, "a")).released(true);
        assert_eq!(
            rules(&h.snapshot()),
            BTreeSet::from([Rule::NotLinearizable])
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_indeterminate_acquire_that_must_have_taken_effect_is_accepted() {
        // Nobody was told of a grant, yet b finds the key busy: only a's unanswered acquire
        // can explain it, so it took effect. Without it, busy on a free key is rejected.
        for with_unknown in [true, false] {
            let h = History::new("model_indeterminate");
            let start = h.start();
            let (a, b) = (h.client("a"), h.client("b"));
            let k = key();
            if with_unknown {
                let op = a.acquire(&k, TTL);
                at(start, 1).await;
                op.unknown("reply lost");
            }
            at(start, 5).await;
            let op = b.acquire(&k, TTL);
            at(start, 6).await;
            op.busy();
            let verdicts = model(&h.snapshot());
            if with_unknown {
                assert_eq!(verdicts, vec![ModelVerdict::Linearizable]);
            } else {
                assert!(not_linearizable(&verdicts), "{verdicts:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_mutex_model_rejects_what_the_older_rules_accept() {
        // a's release answers false (it says a no longer held the key) while a's lease is still
        // definite, and c is granted right after. The older rules end a's hold at its release
        // invoke, whatever the answer; the model knows a release that returned false freed
        // nothing, so the key was still a's when c got it.
        let h = History::new("model_seen_red");
        let start = h.start();
        let (a, c) = (h.client("a"), h.client("c"));
        let k = key();
        let op = a.acquire(&k, TTL);
        at(start, 1).await;
        op.granted(hold(1, "a"));
        at(start, 10).await;
        a.release(hold(1, "a")).released(false);
        at(start, 20).await;
        let op = c.acquire(&k, TTL);
        at(start, 21).await;
        op.granted(hold(2, "c"));
        c.release(hold(2, "c")).released(true);
        let violations = check(&h.snapshot(), &CheckOptions::default());
        assert_eq!(
            violations.iter().map(|v| v.rule).collect::<Vec<_>>(),
            vec![Rule::NotLinearizable],
            "{violations:?}"
        );
        // A release that failed (timed out) may have freed the key: accepted.
        let h = History::new("model_release_timed_out");
        let start = h.start();
        let (a, c) = (h.client("a"), h.client("c"));
        let op = a.acquire(&k, TTL);
        at(start, 1).await;
        op.granted(hold(1, "a"));
        a.release(hold(1, "a")).fail("timed out");
        let op = c.acquire(&k, TTL);
        op.granted(hold(2, "c"));
        assert_eq!(model(&h.snapshot()), vec![ModelVerdict::Linearizable]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_mutex_model_search_is_bounded() {
        // a holds for good (no TTL); 40 unanswered acquires and 40 unanswered force-releases
        // overlap; a's release then returns true after b's grant — impossible, but proving it
        // means trying every subset of the unanswered operations: the search gives up at the
        // cap and says so instead of running for hours.
        let h = History::new("model_bounded");
        let start = h.start();
        let (a, b) = (h.client("a"), h.client("b"));
        let k = key();
        let forever = |n, t| Hold {
            ttl: Duration::ZERO,
            ..hold(n, t)
        };
        a.acquire(&k, TTL).granted(forever(1, "a"));
        at(start, 1).await;
        let pending: Vec<_> = (0..40)
            .flat_map(|n| {
                let c = h.client(format!("c{n}"));
                [c.acquire(&k, TTL), h.client("operator").force_release(&k)]
            })
            .collect();
        at(start, 2).await;
        let op = b.acquire(&k, TTL);
        op.granted(forever(2, "b"));
        a.release(forever(1, "a")).released(true);
        drop(pending);
        let mut records = h.snapshot();
        // No TTL: the grants never expire by themselves.
        for r in &mut records {
            r.ttl_ms = None;
        }
        let started = std::time::Instant::now();
        let reports = check_mutex_model(&records, &CheckOptions::default());
        let took = started.elapsed();
        assert_eq!(reports.len(), 1);
        assert_eq!(
            reports[0].verdict,
            ModelVerdict::Inconclusive,
            "{reports:?}"
        );
        assert!(reports[0].states >= MODEL_SEARCH_CAP);
        eprintln!(
            "{} operations, {} states, {took:?}",
            reports[0].operations, reports[0].states
        );
    }

    #[test]
    fn operations_invoked_or_completed_twice_are_malformed() {
        let rec = |seq, kind| Record {
            seq,
            kind,
            op: Some(Op::Release),
            op_id: Some(1),
            ..Record::default()
        };
        for records in [
            vec![rec(0, Kind::Invoke), rec(1, Kind::Invoke), rec(2, Kind::Ok)],
            vec![rec(0, Kind::Invoke), rec(1, Kind::Ok), rec(2, Kind::Fail)],
        ] {
            let found = check(&records, &CheckOptions::default());
            assert_eq!(
                found.iter().map(|v| v.rule).collect::<Vec<_>>(),
                vec![Rule::Malformed],
                "{found:?}"
            );
        }
    }

    #[test]
    fn malformed_histories_are_reported() {
        let records = vec![Record {
            seq: 0,
            kind: Kind::Ok,
            op: Some(Op::Release),
            op_id: Some(7),
            ..Record::default()
        }];
        assert_eq!(
            check(&records, &CheckOptions::default())
                .iter()
                .map(|v| v.rule)
                .collect::<Vec<_>>(),
            vec![Rule::Malformed]
        );
    }
}
