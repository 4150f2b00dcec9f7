//! Renders a history as an SVG timeline a person can read at a glance.
//!
//! One lane per client; a bar per hold (from the grant to the release, or to the moment the
//! holder learned it lost the lock) labelled with its fencing token; a thin line for the time a
//! client waited to be granted; green dots for accepted writes, red crosses for rejected (stale)
//! writes, grey question marks for writes with unknown outcome; shaded bands for faults (on the
//! lane they hit, or on every lane); a time axis in milliseconds; the checker's verdict on top
//! and its violations underneath. Hovering an element shows its details.

use std::fmt::Write as _;

use super::history::{HistoryFile, Kind, Op, Record};

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 120.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 78.0;
const LANE: f64 = 56.0;
const BAR: f64 = 20.0;

const HOLD_FILL: &str = "#4a7fc1";
const LOST_FILL: &str = "#e8a33d";
const ACCEPTED: &str = "#1e9e4a";
const REJECTED: &str = "#d62828";
const UNKNOWN: &str = "#777777";
const FAULT_COLORS: [&str; 5] = ["#f4a259", "#9d7ad2", "#5bc0be", "#e07a9a", "#bfbf3f"];

/// The SVG document for `history` (with its violations, if any).
pub fn render(history: &HistoryFile) -> String {
    let records = &history.records;
    let lanes = lanes(records);
    let end_us = records.last().map_or(1, |r| r.at_us.max(1));
    let span_us = (end_us as f64 * 1.02).max(1000.0);
    let plot_w = WIDTH - LEFT - RIGHT;
    let x = |us: u64| LEFT + us as f64 / span_us * plot_w;
    let lane_y = |client: &str| {
        lanes
            .iter()
            .position(|c| c == client)
            .map_or(TOP, |i| TOP + i as f64 * LANE)
    };
    let lanes_bottom = TOP + lanes.len().max(1) as f64 * LANE;
    let axis_y = lanes_bottom + 8.0;
    let violations_top = axis_y + 44.0;
    let height = violations_top + 22.0 * history.violations.len().min(30) as f64 + 16.0;

    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">
<rect width="100%" height="100%" fill="#ffffff"/>
"##
    );

    // Title and verdict.
    let (verdict, color) = if history.violations.is_empty() {
        ("checker: all rules hold".to_owned(), ACCEPTED)
    } else {
        (
            format!("checker: {} violation(s)", history.violations.len()),
            REJECTED,
        )
    };
    let _ = write!(
        svg,
        r#"<text x="16" y="26" font-size="18" font-weight="bold">{}</text>
<text x="{:.0}" y="26" font-size="15" font-weight="bold" fill="{color}" text-anchor="end">{}</text>
"#,
        esc(&history.name),
        WIDTH - RIGHT,
        esc(&verdict)
    );
    legend(&mut svg);

    // Lanes.
    for (i, client) in lanes.iter().enumerate() {
        let y = TOP + i as f64 * LANE;
        let fill = if i % 2 == 0 { "#f6f7f9" } else { "#ffffff" };
        let _ = write!(
            svg,
            r##"<rect x="{LEFT}" y="{y}" width="{plot_w}" height="{LANE}" fill="{fill}"/>
<text x="{:.0}" y="{:.1}" text-anchor="end" font-size="14" font-weight="bold">{}</text>
"##,
            LEFT - 10.0,
            y + LANE / 2.0 + 5.0,
            esc(client)
        );
    }

    // Grid and time axis.
    let step_ms = tick_step(span_us / 1000.0);
    let mut t = 0.0;
    while t * 1000.0 <= span_us {
        let px = x((t * 1000.0) as u64);
        let _ = write!(
            svg,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{axis_y}" stroke="#dde1e6" stroke-width="1"/>
<line x1="{px:.1}" y1="{axis_y}" x2="{px:.1}" y2="{:.1}" stroke="#333"/>
<text x="{px:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>
"##,
            axis_y + 5.0,
            axis_y + 18.0,
            fmt_ms(t)
        );
        t += step_ms;
    }
    let _ = write!(
        svg,
        r##"<line x1="{LEFT}" y1="{axis_y}" x2="{:.0}" y2="{axis_y}" stroke="#333"/>
<text x="{:.0}" y="{:.1}" text-anchor="end" font-size="11" fill="#555">time since the drill started (ms)</text>
"##,
        WIDTH - RIGHT,
        WIDTH - RIGHT,
        axis_y + 34.0
    );

    faults(&mut svg, records, &lanes, &x, &lane_y, lanes_bottom, end_us);
    let mut labels = Labels::default();
    // Rejected writes are the story of a drill: their labels get room first.
    let stale_labels: Vec<(u64, String, Option<f64>)> = records
        .iter()
        .filter(|r| r.op == Some(Op::Write) && r.kind == Kind::Fail)
        .filter_map(|r| {
            let lane = lane_y(r.client.as_deref()?);
            let text = stale_label(r);
            let y = labels.place(lane, x(r.at_us) - 8.0, &text);
            Some((r.seq, text, y))
        })
        .collect();
    holds(&mut svg, records, &x, &lane_y, end_us, &mut labels);
    writes(&mut svg, records, &x, &lane_y, &stale_labels);

    // Violations: numbered rings around the records involved, and the list underneath.
    for (i, v) in history.violations.iter().take(30).enumerate() {
        for r in records.iter().filter(|r| {
            v.records.contains(&r.seq)
                && matches!(r.kind, Kind::Ok | Kind::Fail | Kind::Unknown | Kind::Lost)
        }) {
            let Some(client) = r.client.as_deref() else {
                continue;
            };
            let (cx, cy) = (
                x(r.at_us),
                lane_y(client) + (LANE - BAR) / 2.0 + 4.0 + BAR / 2.0,
            );
            let _ = writeln!(
                svg,
                r#"<g><title>{}</title><circle cx="{cx:.1}" cy="{cy:.1}" r="11" fill="none" stroke="{REJECTED}" stroke-width="2"/><text x="{:.1}" y="{:.1}" font-size="10" font-weight="bold" fill="{REJECTED}">{}</text></g>"#,
                esc(&v.message),
                cx + 8.0,
                cy + 18.0,
                i + 1
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="16" y="{:.1}" fill="{REJECTED}" font-size="12">✗ {}. {}: {}</text>"#,
            violations_top + 22.0 * i as f64,
            i + 1,
            esc(&v.rule.to_string()),
            esc(&v.message)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn legend(svg: &mut String) {
    let y = 50.0;
    let _ = write!(
        svg,
        r##"<g font-size="12">
<rect x="16" y="{:.0}" width="28" height="12" fill="{HOLD_FILL}"/><text x="50" y="{:.0}">hold #fencing</text>
<rect x="150" y="{:.0}" width="28" height="12" fill="{LOST_FILL}"/><text x="184" y="{:.0}">held after loss was detectable</text>
<line x1="380" y1="{:.0}" x2="408" y2="{:.0}" stroke="#888" stroke-width="2" stroke-dasharray="3,2"/><text x="414" y="{:.0}">waiting to acquire</text>
<circle cx="552" cy="{:.0}" r="6" fill="{ACCEPTED}"/><text x="564" y="{:.0}">accepted write</text>
<g transform="translate(672,{:.0})" stroke="{REJECTED}" stroke-width="3"><line x1="-6" y1="-6" x2="6" y2="6"/><line x1="-6" y1="6" x2="6" y2="-6"/></g><text x="684" y="{:.0}">rejected (stale) write</text>
<text x="830" y="{:.0}" fill="{UNKNOWN}" font-weight="bold">?</text><text x="842" y="{:.0}">unknown outcome</text>
<rect x="960" y="{:.0}" width="28" height="12" fill="{}" fill-opacity="0.35"/><text x="994" y="{:.0}">fault</text>
</g>
"##,
        y - 10.0,
        y,
        y - 10.0,
        y,
        y - 4.0,
        y - 4.0,
        y,
        y - 4.0,
        y,
        y - 4.0,
        y,
        y,
        y,
        y - 10.0,
        FAULT_COLORS[0],
        y
    );
}

/// Client ids, sorted (so `c1`, `c2`, `c3` read top to bottom).
fn lanes(records: &[Record]) -> Vec<String> {
    let mut out: Vec<String> = records.iter().filter_map(|r| r.client.clone()).collect();
    out.sort();
    out.dedup();
    out
}

/// Places small labels above and below each lane's bars without overprinting: each lane has
/// two rows (above and below the bar); a label goes into the first row where it overlaps no
/// other label, and is left out (its element keeps its hover text) when neither row has room.
#[derive(Default)]
struct Labels {
    /// (row y, label start x, label end x) of every label placed.
    placed: Vec<(f64, f64, f64)>,
}

impl Labels {
    fn place(&mut self, lane_top: f64, x: f64, text: &str) -> Option<f64> {
        let bar_y = lane_top + (LANE - BAR) / 2.0 + 4.0;
        let (x0, x1) = (x - 2.0, x + 6.5 * text.chars().count() as f64 + 2.0);
        let y = [bar_y - 3.0, bar_y + BAR + 11.0].into_iter().find(|y| {
            !self
                .placed
                .iter()
                .any(|(row, a, b)| row == y && *a < x1 && x0 < *b)
        })?;
        self.placed.push((y, x0, x1));
        Some(y)
    }
}

#[allow(clippy::too_many_arguments)]
fn faults(
    svg: &mut String,
    records: &[Record],
    lanes: &[String],
    x: &impl Fn(u64) -> f64,
    lane_y: &impl Fn(&str) -> f64,
    lanes_bottom: f64,
    end_us: u64,
) {
    let mut color_of: Vec<String> = Vec::new();
    for start in records.iter().filter(|r| r.kind == Kind::FaultStart) {
        let name = start.fault.clone().unwrap_or_else(|| "fault".to_owned());
        let ci = match color_of.iter().position(|n| *n == name) {
            Some(i) => i,
            None => {
                color_of.push(name.clone());
                color_of.len() - 1
            }
        };
        let color = FAULT_COLORS[ci % FAULT_COLORS.len()];
        let end = records.iter().find(|r| {
            r.kind == Kind::FaultEnd && r.fault_id == start.fault_id && r.seq > start.seq
        });
        let (x0, x1) = (x(start.at_us), x(end.map_or(end_us, |e| e.at_us)));
        let (y0, h) = match start.target.as_deref() {
            Some(t) if lanes.iter().any(|l| l == t) => (lane_y(t), LANE),
            _ => (TOP, lanes_bottom - TOP),
        };
        let what = match (&start.target, &start.key) {
            (Some(t), _) => format!("{name} ({t})"),
            (None, Some(k)) => format!("{name} ({k})"),
            _ => name.clone(),
        };
        let tip = format!(
            "{what}: {:.1} – {}",
            start.at_ms(),
            end.map_or("never healed".to_owned(), |e| format!(
                "{:.1} ms",
                e.at_ms()
            ))
        );
        let label_y = y0 + 11.0;
        if x1 - x0 < 2.0 {
            // An instantaneous fault (a kill, a forced expiry): a dashed line.
            let _ = write!(
                svg,
                r##"<g><title>{}</title><line x1="{x0:.1}" y1="{y0:.1}" x2="{x0:.1}" y2="{:.1}" stroke="{color}" stroke-width="2" stroke-dasharray="5,3"/>
<text x="{:.1}" y="{label_y:.1}" font-size="11" fill="#444">{}</text></g>
"##,
                esc(&tip),
                y0 + h,
                x0 + 3.0,
                esc(&what)
            );
        } else {
            let _ = write!(
                svg,
                r##"<g><title>{}</title><rect x="{x0:.1}" y="{y0:.1}" width="{:.1}" height="{h:.1}" fill="{color}" fill-opacity="0.35" stroke="{color}" stroke-width="1"/>
<text x="{:.1}" y="{label_y:.1}" font-size="11" font-style="italic" fill="#333">{}</text></g>
"##,
                esc(&tip),
                x1 - x0,
                x0 + 3.0,
                esc(&what)
            );
        }
    }
}

fn same_hold(grant: &Record, r: &Record) -> bool {
    r.client == grant.client && r.key == grant.key && r.token == grant.token
}

fn holds(
    svg: &mut String,
    records: &[Record],
    x: &impl Fn(u64) -> f64,
    lane_y: &impl Fn(&str) -> f64,
    end_us: u64,
    labels: &mut Labels,
) {
    for r in records {
        let Some(client) = r.client.as_deref() else {
            continue;
        };
        let y = lane_y(client);
        let bar_y = y + (LANE - BAR) / 2.0 + 4.0;
        // Waiting to acquire: invoke → completion.
        if r.kind == Kind::Invoke && r.op == Some(Op::Acquire) {
            let done = records
                .iter()
                .find(|d| d.seq > r.seq && d.op_id == r.op_id && d.kind != Kind::Invoke);
            let x0 = x(r.at_us);
            let x1 = x(done.map_or(end_us, |d| d.at_us));
            let outcome = done.map_or("pending", |d| match (d.kind, d.granted) {
                (Kind::Ok, Some(true)) => "granted",
                (Kind::Ok, _) => "busy",
                (Kind::Fail, _) => "failed",
                _ => "unknown",
            });
            let _ = writeln!(
                svg,
                r##"<g><title>{} acquire {:.1} – {}: {outcome}</title><line x1="{x0:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#888" stroke-width="2" stroke-dasharray="3,2"/></g>"##,
                esc(client),
                r.at_ms(),
                done.map_or("end".to_owned(), |d| format!("{:.1} ms", d.at_ms())),
                bar_y + BAR / 2.0,
                x1.max(x0 + 1.0),
                bar_y + BAR / 2.0
            );
            if let Some(d) = done
                && matches!(d.kind, Kind::Fail | Kind::Unknown)
            {
                let _ = writeln!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" font-size="10" fill="{UNKNOWN}">{}</text>"#,
                    x1 + 2.0,
                    bar_y - 2.0,
                    if d.kind == Kind::Fail {
                        "failed"
                    } else {
                        "unknown"
                    }
                );
            }
        }
        // A renewal: a tick at the local deadline it gave (the checker's definite lease end).
        if r.kind == Kind::Renewed
            && let Some(deadline) = r.deadline_us
        {
            let xd = x(deadline.min(end_us));
            let _ = writeln!(
                svg,
                r##"<g><title>{} renewed ({} so far): trusted until {:.1} ms</title><line x1="{xd:.1}" y1="{:.1}" x2="{xd:.1}" y2="{:.1}" stroke="#555" stroke-width="2"/></g>"##,
                esc(client),
                r.renewals.unwrap_or(0),
                deadline as f64 / 1000.0,
                bar_y - 3.0,
                bar_y + BAR + 3.0
            );
        }
        if !(r.kind == Kind::Ok && r.op == Some(Op::Acquire) && r.granted == Some(true)) {
            continue;
        }
        let release = records.iter().find(|e| {
            e.seq > r.seq && same_hold(r, e) && e.kind == Kind::Invoke && e.op == Some(Op::Release)
        });
        let lost = records
            .iter()
            .find(|e| e.seq > r.seq && same_hold(r, e) && e.kind == Kind::Lost);
        let released_at = release.map(|rel| {
            records
                .iter()
                .find(|d| d.seq > rel.seq && d.op_id == rel.op_id && d.kind != Kind::Invoke)
                .map_or(end_us, |d| d.at_us)
        });
        let end = released_at.unwrap_or(end_us);
        let x0 = x(r.at_us);
        // Solid while trusted; amber from the loss onwards (the holder still acting on it).
        let trusted_end = lost.map_or(end, |l| l.at_us.min(end));
        let x_trusted = x(trusted_end);
        let x1 = x(end.max(trusted_end));
        let label = r
            .fencing
            .map_or_else(|| r.token.clone().unwrap_or_default(), |f| format!("#{f}"));
        let tip = format!(
            "{client} holds {} {label} (token {}) from {:.1} ms{}{}",
            r.key.as_deref().unwrap_or(""),
            r.token.as_deref().unwrap_or("?"),
            r.at_ms(),
            lost.map_or(String::new(), |l| format!(
                "; lost at {:.1} ms ({})",
                l.at_ms(),
                l.detail.as_deref().unwrap_or("")
            )),
            released_at.map_or(String::new(), |t| format!(
                "; released at {:.1} ms",
                t as f64 / 1000.0
            )),
        );
        let _ = writeln!(
            svg,
            r#"<g><title>{}</title><rect x="{x0:.1}" y="{bar_y:.1}" width="{:.1}" height="{BAR}" rx="3" fill="{HOLD_FILL}"/>"#,
            esc(&tip),
            (x_trusted - x0).max(2.0)
        );
        if x1 - x_trusted > 0.5 {
            let _ = writeln!(
                svg,
                r#"<rect x="{x_trusted:.1}" y="{bar_y:.1}" width="{:.1}" height="{BAR}" rx="3" fill="{LOST_FILL}"/>"#,
                x1 - x_trusted
            );
        }
        // The label goes inside the bar when it fits with room for write marks, else above or
        // below it.
        let width = x1.max(x_trusted) - x0;
        let text_w = 7.0 * label.chars().count() as f64 + 4.0;
        if width >= text_w + 24.0 {
            let _ = write!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" font-size="12" font-weight="bold" fill="#fff" text-anchor="middle">{}</text>"##,
                x0 + width / 2.0,
                bar_y + BAR / 2.0 + 4.0,
                esc(&label)
            );
        } else if let Some(ly) = labels.place(y, x0, &label) {
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{ly:.1}" font-size="11" font-weight="bold" fill="{HOLD_FILL}">{}</text>"#,
                x0,
                esc(&label)
            );
        }
        if let Some(l) = lost {
            let lx = x(l.at_us);
            let _ = write!(
                svg,
                r##"<line x1="{lx:.1}" y1="{:.1}" x2="{lx:.1}" y2="{:.1}" stroke="#a05a00" stroke-width="2"/>"##,
                bar_y - 3.0,
                bar_y + BAR + 3.0
            );
            if let Some(ly) = labels.place(y, lx, "lost") {
                let _ = write!(
                    svg,
                    r##"<text x="{lx:.1}" y="{ly:.1}" font-size="10" font-weight="bold" fill="#a05a00">lost</text>"##
                );
            }
        }
        svg.push_str("</g>\n");
    }
}

fn writes(
    svg: &mut String,
    records: &[Record],
    x: &impl Fn(u64) -> f64,
    lane_y: &impl Fn(&str) -> f64,
    stale_labels: &[(u64, String, Option<f64>)],
) {
    for done in records
        .iter()
        .filter(|r| r.op == Some(Op::Write) && r.kind != Kind::Invoke)
    {
        let Some(client) = done.client.as_deref() else {
            continue;
        };
        let value = records
            .iter()
            .find(|i| i.op_id == done.op_id && i.kind == Kind::Invoke)
            .and_then(|i| i.value.clone())
            .unwrap_or_default();
        let cx = x(done.at_us);
        let cy = lane_y(client) + (LANE - BAR) / 2.0 + 4.0 + BAR / 2.0;
        let fencing = done.fencing.map_or("-".to_owned(), |f| format!("#{f}"));
        match done.kind {
            Kind::Ok => {
                let _ = writeln!(
                    svg,
                    r##"<g><title>{} wrote {} with {fencing} at {:.1} ms: accepted</title><circle cx="{cx:.1}" cy="{cy:.1}" r="6" fill="{ACCEPTED}" stroke="#fff" stroke-width="1.5"/></g>"##,
                    esc(client),
                    esc(&value),
                    done.at_ms()
                );
            }
            Kind::Fail => {
                let highest = done.highest.map_or(String::new(), |h| format!(" < #{h}"));
                let _ = write!(
                    svg,
                    r#"<g><title>{} wrote {} with {fencing} at {:.1} ms: rejected ({}{})</title><g transform="translate({cx:.1},{cy:.1})" stroke="{REJECTED}" stroke-width="3.5"><line x1="-7" y1="-7" x2="7" y2="7"/><line x1="-7" y1="7" x2="7" y2="-7"/></g>"#,
                    esc(client),
                    esc(&value),
                    done.at_ms(),
                    esc(done.error.as_deref().unwrap_or("")),
                    esc(&highest)
                );
                if let Some((_, text, Some(ly))) = stale_labels.iter().find(|l| l.0 == done.seq) {
                    let _ = write!(
                        svg,
                        r#"<text x="{:.1}" y="{ly:.1}" font-size="11" font-weight="bold" fill="{REJECTED}">{}</text>"#,
                        cx - 8.0,
                        esc(text)
                    );
                }
                svg.push_str("</g>\n");
            }
            _ => {
                let _ = writeln!(
                    svg,
                    r#"<g><title>{} wrote {} with {fencing} at {:.1} ms: outcome unknown</title><text x="{cx:.1}" y="{:.1}" font-size="16" font-weight="bold" fill="{UNKNOWN}" text-anchor="middle">?</text></g>"#,
                    esc(client),
                    esc(&value),
                    done.at_ms(),
                    cy + 6.0
                );
            }
        }
    }
}

fn stale_label(write: &Record) -> String {
    let fencing = write.fencing.map_or("-".to_owned(), |f| format!("#{f}"));
    let highest = write.highest.map_or(String::new(), |h| format!(" < #{h}"));
    format!("stale {fencing}{highest}")
}

/// A tick step (in ms) of 1, 2 or 5 × 10^k giving at most ~12 ticks over `span_ms`.
fn tick_step(span_ms: f64) -> f64 {
    let raw = (span_ms / 12.0).max(0.001);
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|step| *step >= raw)
        .unwrap_or(10.0 * magnitude)
}

fn fmt_ms(t: f64) -> String {
    if t >= 1.0 || t == 0.0 {
        format!("{t:.0}")
    } else {
        format!("{t:.2}")
    }
}

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(1000.0), 100.0);
        assert_eq!(tick_step(120.0), 10.0);
        assert_eq!(tick_step(3000.0), 500.0);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(esc(r#"<a & "b">"#), "&lt;a &amp; &quot;b&quot;&gt;");
    }
}
