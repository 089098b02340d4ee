//! `strata top`: a live view of every process, device, tier and tag, refreshed twice a second,
//! sorted by reserved bytes, with per-process rates; `--once` prints one frame (and `--svg`
//! writes it as an image).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row as TableRow, Table};
use ratatui::{Frame, Terminal};
use strata_ops::{read_all, Folder, FolderError, Listing};

use super::{failed, rows, Row};
use crate::cli::size;

mod svg;

#[derive(Args)]
pub struct TopArgs {
    /// Print one frame and exit (two readings one refresh apart, for the rates).
    #[arg(long)]
    pub once: bool,
    /// With `--once`: also write the frame as an SVG image to this file.
    #[arg(long, requires = "once")]
    pub svg: Option<PathBuf>,
    /// With `--once`: the frame's width in columns.
    #[arg(long, default_value_t = 150)]
    pub width: u16,
}

/// How often the view reads the folder again.
const REFRESH: Duration = Duration::from_millis(500);

/// The sort orders `s` cycles through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sort {
    Reserved,
    Allocated,
    AllocRate,
    MovedRate,
    Pid,
}

impl Sort {
    fn next(self) -> Sort {
        match self {
            Sort::Reserved => Sort::Allocated,
            Sort::Allocated => Sort::AllocRate,
            Sort::AllocRate => Sort::MovedRate,
            Sort::MovedRate => Sort::Pid,
            Sort::Pid => Sort::Reserved,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Sort::Reserved => "reserved",
            Sort::Allocated => "allocated",
            Sort::AllocRate => "allocs/s",
            Sort::MovedRate => "moved/s",
            Sort::Pid => "pid",
        }
    }
}

type Key = (u32, String, Option<u32>);

/// A row's counters at one reading.
#[derive(Clone, Copy)]
struct Sample {
    at_ms: u64,
    allocs: u64,
    moved: u64,
}

/// Allocations per second and bytes moved between tiers per second.
#[derive(Clone, Copy, Default)]
struct Rates {
    allocs: f64,
    moved: f64,
}

struct View {
    folder: Folder,
    listing: Listing,
    samples: HashMap<Key, Sample>,
    rates: HashMap<Key, Rates>,
    sort: Sort,
    reverse: bool,
    filter: String,
    editing: bool,
}

impl View {
    fn new(folder: Folder) -> View {
        View {
            folder,
            listing: Listing::default(),
            samples: HashMap::new(),
            rates: HashMap::new(),
            sort: Sort::Reserved,
            reverse: false,
            filter: String::new(),
            editing: false,
        }
    }

    /// Reads the folder again; rates from the counters' change since the last reading that
    /// the process had published anew.
    fn refresh(&mut self) -> Result<(), FolderError> {
        self.listing = read_all(&self.folder)?;
        let mut samples = HashMap::new();
        for r in rows(&self.listing) {
            let now = Sample {
                at_ms: r.process.updated_unix_ms,
                allocs: r.get(|d| d.allocs),
                moved: r.get(|d| d.moved_bytes),
            };
            let key = r.key();
            match self.samples.get(&key) {
                Some(before) if now.at_ms > before.at_ms => {
                    let secs = (now.at_ms - before.at_ms) as f64 / 1000.0;
                    let per_s = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
                    self.rates.insert(
                        key.clone(),
                        Rates {
                            allocs: per_s(now.allocs, before.allocs),
                            moved: per_s(now.moved, before.moved),
                        },
                    );
                    samples.insert(key, now);
                }
                Some(&before) => {
                    samples.insert(key, before);
                }
                None => {
                    samples.insert(key, now);
                }
            }
        }
        self.rates.retain(|k, _| samples.contains_key(k));
        self.samples = samples;
        Ok(())
    }

    fn matches(&self, r: &Row<'_>) -> bool {
        let f = self.filter.to_lowercase();
        f.is_empty()
            || r.process.pid.to_string().contains(&f)
            || r.process.command.to_lowercase().contains(&f)
            || r.device
                .is_some_and(|d| d.tags.iter().any(|t| t.name.to_lowercase().contains(&f)))
    }

    /// The rows shown, filtered and sorted.
    fn shown(&self) -> Vec<Row<'_>> {
        let mut rows: Vec<Row<'_>> = rows(&self.listing)
            .into_iter()
            .filter(|r| self.matches(r))
            .collect();
        let rate = |r: &Row<'_>| self.rates.get(&r.key()).copied().unwrap_or_default();
        rows.sort_by(|a, b| {
            let order = match self.sort {
                Sort::Pid => a.key().cmp(&b.key()),
                Sort::Reserved => b
                    .get(|d| d.reserved_bytes)
                    .cmp(&a.get(|d| d.reserved_bytes)),
                Sort::Allocated => b
                    .get(|d| d.allocated_bytes)
                    .cmp(&a.get(|d| d.allocated_bytes)),
                Sort::AllocRate => rate(b).allocs.total_cmp(&rate(a).allocs),
                Sort::MovedRate => rate(b).moved.total_cmp(&rate(a).moved),
            };
            order.then_with(|| a.key().cmp(&b.key()))
        });
        if self.reverse {
            rows.reverse();
        }
        rows
    }

    /// Handles a key; whether to quit.
    fn key(&mut self, code: KeyCode) -> bool {
        if self.editing {
            match code {
                KeyCode::Enter => self.editing = false,
                KeyCode::Esc => {
                    self.editing = false;
                    self.filter.clear();
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) => self.filter.push(c),
                _ => {}
            }
            return false;
        }
        match code {
            KeyCode::Char('q') | KeyCode::Esc => return true,
            KeyCode::Char('s') => self.sort = self.sort.next(),
            KeyCode::Char('r') => self.reverse = !self.reverse,
            KeyCode::Char('/') => self.editing = true,
            KeyCode::Char('c') => self.filter.clear(),
            _ => {}
        }
        false
    }

    /// Lines the frame needs (for `--once`).
    fn height(&self) -> u16 {
        let rows = self.shown();
        let details: usize = rows
            .iter()
            .filter_map(|r| r.device)
            .map(|d| d.tags.len() + d.kv_spaces.len())
            .sum();
        (2 + rows.len() + 3 + details + 3).min(1000) as u16
    }

    fn draw(&self, frame: &mut Frame<'_>) {
        let rows = self.shown();
        let [head, procs, details] = Layout::vertical([
            Constraint::Length(2),
            Constraint::Length(rows.len() as u16 + 3),
            Constraint::Min(3),
        ])
        .areas(frame.area());
        let processes = self.listing.processes.len();
        let filter = if self.editing {
            format!("  filter: {}_", self.filter)
        } else if self.filter.is_empty() {
            String::new()
        } else {
            format!("  filter: {}", self.filter)
        };
        let arrow = if self.reverse { "↑" } else { "↓" };
        frame.render_widget(
            Paragraph::new(vec![
                Line::from(vec![
                    "strata top".bold().cyan(),
                    format!(
                        "  {processes} process(es), {} row(s)  sort: {} {arrow}{filter}",
                        rows.len(),
                        self.sort.label()
                    )
                    .into(),
                ]),
                Line::from("q quit  s sort  r reverse  / filter  c clear filter".dark_gray()),
            ]),
            head,
        );
        frame.render_widget(self.process_table(&rows), procs);
        frame.render_widget(detail_table(&rows), details);
    }

    fn process_table(&self, rows: &[Row<'_>]) -> Table<'static> {
        let header = [
            "PID", "LIB", "COMMAND", "DEV", "RESERVED", "ALLOC'D", "PEAK", "LIMIT", "DEVICE",
            "HOST", "DISK", "LENT", "BORROWED", "OOM", "ALLOC/s", "MOVED/s",
        ];
        let body = rows.iter().map(|r| {
            let rate = self.rates.get(&r.key()).copied();
            let limit = r.device.and_then(|d| d.limit_bytes);
            let bytes = |v: u64| size(v);
            let limit_style = if limit.is_some() {
                Style::new().yellow()
            } else {
                Style::new()
            };
            TableRow::new(vec![
                r.process.pid.to_string().into(),
                r.process.library.clone().into(),
                r.process.command.clone().into(),
                r.device.map_or("-".into(), |d| d.device.to_string()).into(),
                bytes(r.get(|d| d.reserved_bytes)).bold().into(),
                bytes(r.get(|d| d.allocated_bytes)).into(),
                bytes(r.get(|d| d.peak_allocated_bytes)).into(),
                ratatui::text::Span::styled(limit.map_or("none".into(), size), limit_style).into(),
                bytes(r.get(|d| d.tiers.device)).green().into(),
                bytes(r.get(|d| d.tiers.host)).blue().into(),
                bytes(r.get(|d| d.tiers.disk)).magenta().into(),
                bytes(r.get(|d| d.lent_bytes)).into(),
                bytes(r.get(|d| d.borrowed_bytes)).into(),
                oom_cell(r.get(|d| d.ooms)),
                rate.map_or("-".into(), |x| format!("{:.0}", x.allocs))
                    .into(),
                rate.map_or("-".into(), |x| format!("{}/s", size(x.moved as u64)))
                    .into(),
            ])
        });
        let widths =
            [7, 7, 10, 3, 10, 10, 10, 10, 10, 10, 9, 8, 9, 3, 7, 10].map(Constraint::Length);
        Table::new(body, widths)
            .header(TableRow::new(header).style(Style::new().bold().reversed()))
            .block(Block::bordered().title(" processes and devices "))
    }
}

fn oom_cell(ooms: u64) -> Cell<'static> {
    if ooms > 0 {
        ooms.to_string().red().bold().into()
    } else {
        ooms.to_string().into()
    }
}

/// Tags and KV spaces of the rows shown.
fn detail_table(rows: &[Row<'_>]) -> Table<'static> {
    let mut body = Vec::new();
    for r in rows {
        let Some(d) = r.device else { continue };
        for t in &d.tags {
            let state = match t.state {
                strata_ops::TagState::Awake => t.state.as_str().green(),
                strata_ops::TagState::Asleep => t.state.as_str().yellow(),
                strata_ops::TagState::Offloaded => t.state.as_str().blue(),
            };
            body.push(TableRow::new::<Vec<Cell<'static>>>(vec![
                r.process.pid.to_string().into(),
                d.device.to_string().into(),
                "tag".into(),
                t.name.clone().into(),
                state.into(),
                size(t.bytes.device + t.bytes.peer).into(),
                size(t.bytes.host).into(),
                size(t.bytes.disk).into(),
                format!("{} allocated", size(t.allocated_bytes)).into(),
            ]));
        }
        for k in &d.kv_spaces {
            body.push(TableRow::new::<Vec<Cell<'static>>>(vec![
                r.process.pid.to_string().into(),
                d.device.to_string().into(),
                "kv".into(),
                format!("space {}", k.id).into(),
                format!("{} req", k.requests).into(),
                size(k.bytes.device).into(),
                size(k.bytes.host).into(),
                size(k.bytes.disk).into(),
                format!(
                    "{} tokens, prefetch {} hit / {} miss",
                    k.tokens, k.prefetch_hits, k.prefetch_misses
                )
                .into(),
            ]));
        }
    }
    let widths = [7, 3, 4, 16, 10, 10, 10, 10, 40].map(Constraint::Length);
    let header = [
        "PID", "DEV", "KIND", "NAME", "STATE", "DEVICE", "HOST", "DISK", "DETAIL",
    ];
    Table::new(body, widths)
        .header(TableRow::new(header).style(Style::new().bold().reversed()))
        .block(Block::bordered().title(" tags and KV spaces "))
}

pub fn run(args: TopArgs) -> Result<ExitCode, strata::Error> {
    let folder = match Folder::from_env() {
        Ok(f) => f,
        Err(e) => return failed(e),
    };
    let mut view = View::new(folder);
    if let Err(e) = view.refresh() {
        return failed(e);
    }
    for w in &view.listing.warnings {
        eprintln!("strata: warning: {w}");
    }
    if args.once {
        std::thread::sleep(REFRESH);
        if let Err(e) = view.refresh() {
            return failed(e);
        }
        return once(&view, args.width, args.svg);
    }
    let mut terminal = ratatui::init();
    let outcome = live(&mut terminal, &mut view);
    ratatui::restore();
    match outcome {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => failed(e),
    }
}

fn live(terminal: &mut ratatui::DefaultTerminal, view: &mut View) -> Result<(), String> {
    let mut read_at = Instant::now();
    loop {
        terminal.draw(|f| view.draw(f)).map_err(|e| e.to_string())?;
        let wait = REFRESH.saturating_sub(read_at.elapsed());
        if event::poll(wait).map_err(|e| e.to_string())? {
            if let Event::Key(k) = event::read().map_err(|e| e.to_string())? {
                if k.kind == KeyEventKind::Press && view.key(k.code) {
                    return Ok(());
                }
            }
        }
        if read_at.elapsed() >= REFRESH {
            view.refresh().map_err(|e| e.to_string())?;
            read_at = Instant::now();
        }
    }
}

/// Prints one frame as text (and writes it as SVG).
fn once(view: &View, width: u16, svg_path: Option<PathBuf>) -> Result<ExitCode, strata::Error> {
    let Ok(mut terminal) = Terminal::new(TestBackend::new(width, view.height()));
    let Ok(_) = terminal.draw(|f| view.draw(f));
    let buffer = terminal.backend().buffer();
    for y in 0..buffer.area.height {
        let line: String = (0..buffer.area.width)
            .map(|x| buffer[(x, y)].symbol())
            .collect();
        println!("{}", line.trim_end());
    }
    if let Some(path) = svg_path {
        std::fs::write(&path, svg::render(buffer)).map_err(|source| strata::Error::Os {
            call: "write svg",
            source,
        })?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The colours the view uses, as SVG fills.
fn color(c: Color, default: &'static str) -> &'static str {
    match c {
        Color::Cyan => "#56b6c2",
        Color::Yellow => "#e5c07b",
        Color::Green => "#98c379",
        Color::Red => "#e06c75",
        Color::Blue => "#61afef",
        Color::Magenta => "#c678dd",
        Color::DarkGray => "#7f848e",
        Color::White | Color::Gray => "#dcdfe4",
        Color::Black => "#282c34",
        _ => default,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_reverse_filter_and_quit() {
        let mut v = View::new(Folder::at("/nonexistent"));
        assert_eq!(v.sort, Sort::Reserved);
        for want in [
            Sort::Allocated,
            Sort::AllocRate,
            Sort::MovedRate,
            Sort::Pid,
            Sort::Reserved,
        ] {
            assert!(!v.key(KeyCode::Char('s')));
            assert_eq!(v.sort, want);
        }
        assert!(!v.key(KeyCode::Char('r')));
        assert!(v.reverse);
        assert!(!v.key(KeyCode::Char('/')));
        for c in "wq".chars() {
            assert!(!v.key(KeyCode::Char(c)), "typing a filter never quits");
        }
        assert!(!v.key(KeyCode::Backspace));
        assert!(!v.key(KeyCode::Enter));
        assert_eq!(v.filter, "w");
        assert!(!v.key(KeyCode::Char('c')));
        assert!(v.filter.is_empty());
        assert!(v.key(KeyCode::Char('q')));
    }
}
