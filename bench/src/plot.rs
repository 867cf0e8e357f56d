//! PNG output of a benchmark run: latency percentile curves next to a
//! throughput bar chart.
//!
//! Rendering is pure Rust (plotters' bitmap backend with the `ab_glyph` text
//! renderer): no system libraries are needed at build time. Text needs a
//! TrueType font at run time, read from [`DEFAULT_FONT_PATH`] (Debian
//! package `fonts-dejavu-core`) or from the file named by the
//! [`FONT_ENV`] environment variable.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::register_font;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// The font file read at run time unless [`FONT_ENV`] names another one
/// (Debian/Ubuntu package `fonts-dejavu-core`).
pub const DEFAULT_FONT_PATH: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// Environment variable that, when set, names the TrueType/OpenType font
/// file to use instead of [`DEFAULT_FONT_PATH`].
pub const FONT_ENV: &str = "KVNODE_BENCH_FONT";

/// Image size in pixels.
const SIZE: (u32, u32) = (1200, 800);
/// Nines-scale positions of the labelled percentiles 50, 90, 99, 99.9,
/// 99.99 (the axis extends further when the data does).
const MIN_X_MAX: f64 = 4.0;
/// Height in pixels of the title strip.
const TITLE_HEIGHT: u32 = 56;
/// Series and bar colors (the "tab10" palette: distinct and legible on
/// white).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// Margin around each chart, pixels.
const CHART_MARGIN: u32 = 12;
/// Width of the bar chart's y label area, pixels.
const BAR_Y_LABEL_AREA: u32 = 60;

/// The furthest the nines axis goes (99.9999999th percentile).
const MAX_NINES: f64 = 9.0;

/// One latency curve: a name plus `(percentile in 0..100, microseconds)`
/// points.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyCurve {
    /// Legend label, e.g. `"store 1 MiB"`.
    pub name: String,
    /// `(percentile, latency in µs)` points, in percentile order.
    /// Points that cannot be drawn (percentile outside `[0, 100)`, e.g. the
    /// 100th percentile, which is infinitely far right on a nines axis, or a
    /// latency that is not a positive finite number) are skipped: pass the
    /// maximum as e.g. 99.9999 to show it.
    pub points: Vec<(f64, f64)>,
}

/// Draws a PNG of about 1200x800 pixels at `path` with `title` on top and
/// two panels:
///
/// * left: the latency percentile `curves`, x on a "nines" scale (plotted
///   at `-log10(1 - p/100)`, ticks labelled 50, 90, 99, 99.9, 99.99 and
///   further nines if the data goes there), y log-scale microseconds;
/// * right: a bar chart of `throughput_gbps` (label, GB/s), one bar per
///   entry in the given order, each with its value printed above it
///   (non-finite or negative values are drawn as an empty "n/a" bar).
///
/// Empty inputs give empty (but labelled) panels.
///
/// # Errors
///
/// A message (as text, never a panic) when the font cannot be read or
/// parsed (see [`DEFAULT_FONT_PATH`]; the message names the Debian package
/// to install), or drawing, encoding or writing the file fails.
pub fn write_png(
    path: &Path,
    title: &str,
    curves: &[LatencyCurve],
    throughput_gbps: &[(String, f64)],
) -> Result<(), String> {
    ensure_font()?;
    let err = |e: DrawingAreaErrorKind<_>| format!("plot {}: {e}", path.display());
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    // Drawn by hand rather than with `titled`: the ab_glyph renderer places
    // glyphs higher than the layout estimate, which clips a title at y = 0.
    let (head, body) = root.split_vertically(TITLE_HEIGHT);
    let title_style = ("sans-serif", 28)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    head.draw_text(title, &title_style, (SIZE.0 as i32 / 2, 16))
        .map_err(err)?;
    let (left, right) = body.split_horizontally(SIZE.0 * 60 / 100);
    draw_latency(&left, curves).map_err(err)?;
    draw_throughput(&right, throughput_gbps).map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Maps a percentile to the nines axis: `-log10(1 - p/100)`.
fn nines(p: f64) -> f64 {
    -(1.0 - p / 100.0).log10()
}

/// Tick label for a nines-axis position: the percentile with just enough
/// decimals (0.301 -> "50", 1 -> "90", 3 -> "99.9").
fn nines_label(x: f64) -> String {
    let p = 100.0 * (1.0 - 10f64.powf(-x));
    let decimals = (x.round() as i64 - 2).max(0) as usize;
    format!("{p:.decimals$}")
}

/// Compact microsecond label for the log axis.
fn us_label(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{}", (v * 10.0).round() / 10.0)
    } else {
        format!("{}", (v * 1000.0).round() / 1000.0)
    }
}

/// The x axis of the latency panel: linear in nines (`0..max`), with tick
/// marks only at the labelled percentiles (50, 90, 99, ...).
struct NinesAxis {
    max: f64,
}

impl NinesAxis {
    fn ticks(&self) -> Vec<f64> {
        let mut t = vec![2f64.log10()];
        t.extend((1..=self.max.floor() as i32).map(f64::from));
        t
    }
}

impl Ranged for NinesAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let frac = value / self.max;
        limit.0 + (f64::from(limit.1 - limit.0) * frac).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.ticks()
    }

    fn range(&self) -> std::ops::Range<f64> {
        0.0..self.max
    }
}

/// The drawable points of a curve, mapped to (nines, µs).
fn drawable(curve: &LatencyCurve) -> Vec<(f64, f64)> {
    curve
        .points
        .iter()
        .filter(|(p, us)| (0.0..100.0).contains(p) && us.is_finite() && *us > 0.0)
        .map(|&(p, us)| (nines(p).min(MAX_NINES), us))
        .collect()
}

fn draw_latency<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    curves: &[LatencyCurve],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let mapped: Vec<Vec<(f64, f64)>> = curves.iter().map(drawable).collect();
    let all = mapped.iter().flatten();
    let x_data_max = all.clone().map(|p| p.0).fold(0.0, f64::max);
    let x_max = x_data_max.ceil().clamp(MIN_X_MAX, MAX_NINES);
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    // Whole decades, so that the log axis always has labelled ticks.
    let (y_lo, y_hi) = if hi > 0.0 {
        let lo_exp = lo.log10().floor();
        let hi_exp = (hi * 1.05).log10().ceil().max(lo_exp + 1.0);
        (10f64.powf(lo_exp), 10f64.powf(hi_exp))
    } else {
        (1.0, 1000.0)
    };

    let mut chart = ChartBuilder::on(area)
        .caption("Latency by percentile", ("sans-serif", 22))
        .margin(CHART_MARGIN)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(NinesAxis { max: x_max }, (y_lo..y_hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (µs)")
        .x_label_formatter(&|x| nines_label(*x))
        .y_label_formatter(&|y| us_label(*y))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()?;

    for (i, (curve, pts)) in curves.iter().zip(&mapped).enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(curve.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    if !curves.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()?;
    }
    Ok(())
}

fn draw_throughput<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    bars: &[(String, f64)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let value = |v: f64| (v.is_finite() && v >= 0.0).then_some(v);
    let max = bars.iter().filter_map(|b| value(b.1)).fold(0.0, f64::max);
    let y_max = if max > 0.0 { max * 1.15 } else { 1.0 };
    let n = bars.len().max(1);
    // Shrink the bar labels until the widest fits its bar slot.
    let slot =
        (area.dim_in_pixel().0 as f64 - f64::from(BAR_Y_LABEL_AREA + 2 * CHART_MARGIN)) / n as f64;
    let mut label_size = 15u32;
    while label_size > 9 {
        let style = ("sans-serif", label_size).into_text_style(area);
        let mut widest = 0u32;
        for (label, _) in bars {
            widest = widest.max(area.estimate_text_size(label, &style)?.0);
        }
        if f64::from(widest) <= slot - 6.0 {
            break;
        }
        label_size -= 1;
    }

    let mut chart = ChartBuilder::on(area)
        .caption("Throughput", ("sans-serif", 22))
        .margin(CHART_MARGIN)
        .x_label_area_size(50)
        .y_label_area_size(BAR_Y_LABEL_AREA)
        // An integer range is inclusive in plotters: 0..n-1 gives n slots.
        .build_cartesian_2d((0..n - 1).into_segmented(), 0f64..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc("GB/s")
        .x_labels(n)
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => bars.get(*i).map(|b| b.0.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 15))
        .x_label_style(("sans-serif", label_size))
        .axis_desc_style(("sans-serif", 17))
        .draw()?;

    for (i, (_, v)) in bars.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let text = match value(*v) {
            Some(v) => {
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), 0.0),
                        (SegmentValue::Exact(i + 1), v),
                    ],
                    color.filled(),
                );
                bar.set_margin(0, 0, 12, 12);
                chart.draw_series(std::iter::once(bar))?;
                format!("{v:.2}")
            }
            None => "n/a".to_string(),
        };
        let top = value(*v).unwrap_or(0.0);
        let style = ("sans-serif", 16)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(std::iter::once(Text::new(
            text,
            (SegmentValue::CenterOf(i), top),
            style,
        )))?;
    }
    Ok(())
}

/// Reads the font file, with an error that says how to get one.
fn read_font(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| {
        format!(
            "plot: cannot read font {}: {e} (install the Debian package \
             fonts-dejavu-core, or set {FONT_ENV} to a .ttf file)",
            path.display()
        )
    })
}

/// Loads the font once per process and registers it for the families the
/// charts use. The outcome (success or the error text) is cached.
fn ensure_font() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let path = std::env::var_os(FONT_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_FONT_PATH));
        let bytes = read_font(&path)?;
        // plotters keeps fonts for the life of the process and wants
        // &'static bytes; this happens once, so leaking is bounded.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        for family in ["sans-serif", "serif", "monospace"] {
            register_font(family, FontStyle::Normal, bytes).map_err(|_| {
                format!(
                    "plot: {} is not a usable TrueType/OpenType font",
                    path.display()
                )
            })?;
        }
        Ok(())
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(name: &str, scale: f64) -> LatencyCurve {
        let ps = [0.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.99, 100.0];
        LatencyCurve {
            name: name.into(),
            points: ps
                .iter()
                .enumerate()
                .map(|(i, &p)| (p, scale * (1.0 + i as f64 * i as f64)))
                .collect(),
        }
    }

    #[test]
    fn writes_a_png() {
        let dir = std::env::temp_dir().join(format!("kvnode-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.png");
        let curves = [curve("store 1 MiB", 40.0), curve("retrieve 1 MiB", 25.0)];
        let bars = [
            ("store".to_string(), 7.5),
            ("retrieve".to_string(), 9.25),
            ("memcpy write".to_string(), 11.0),
            ("memcpy read".to_string(), 14.5),
        ];
        write_png(&path, "kvnode bench: 1 MiB, 4 clients", &curves, &bars).expect("write_png");
        let data = std::fs::read(&path).unwrap();
        assert!(data.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert!(data.len() > 20_000, "only {} bytes", data.len());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_and_odd_inputs_do_not_fail() {
        let dir =
            std::env::temp_dir().join(format!("kvnode-bench-plot-odd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("empty.png");
        write_png(&path, "", &[], &[]).expect("empty plot");
        assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));
        let odd = [LatencyCurve {
            name: "odd".into(),
            points: vec![
                (-1.0, 5.0),
                (50.0, f64::NAN),
                (99.0, 0.0),
                (100.0, 9.0),
                (99.9999999999, 3.0),
            ],
        }];
        let bars = [("nan".to_string(), f64::NAN), ("zero".to_string(), 0.0)];
        write_png(&path, "odd", &odd, &bars).expect("odd plot");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unwritable_path_is_an_error() {
        let path = Path::new("/nonexistent-kvnode-dir/x/run.png");
        let e = write_png(path, "t", &[curve("c", 1.0)], &[]).unwrap_err();
        assert!(e.contains("run.png"), "{e}");
    }

    #[test]
    fn missing_font_is_a_clear_error() {
        let e = read_font(Path::new("/nonexistent/DejaVuSans.ttf")).unwrap_err();
        assert!(
            e.contains("fonts-dejavu-core") && e.contains(FONT_ENV),
            "{e}"
        );
    }

    #[test]
    fn nines_axis_labels() {
        assert!((nines(90.0) - 1.0).abs() < 1e-9);
        assert!((nines(99.9) - 3.0).abs() < 1e-9);
        let labels: Vec<String> = [2f64.log10(), 1.0, 2.0, 3.0, 4.0, 5.0]
            .iter()
            .map(|&x| nines_label(x))
            .collect();
        assert_eq!(labels, ["50", "90", "99", "99.9", "99.99", "99.999"]);
        assert_eq!(us_label(1234.4), "1234");
        assert_eq!(us_label(12.34), "12.3");
        assert_eq!(us_label(0.25), "0.25");
    }
}
