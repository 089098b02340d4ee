//! A small SVG line-chart writer shared by `strata demo --plot` and the `strata sim` commands: a
//! few polylines, two axes and a legend need no plotting dependency.

/// One line of a chart: name, colour and `(x, y)` points.
pub struct Series<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub points: Vec<(f64, f64)>,
}

/// Writes an SVG line chart of `series` to `path` (x from the smallest to the largest x, y from
/// 0); an I/O failure is [`strata::Error::Os`].
pub fn write_chart(
    path: &std::path::Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series<'_>],
) -> strata::Result<()> {
    let (w, h, m) = (800.0f64, 360.0f64, 50.0f64);
    let all = || series.iter().flat_map(|s| s.points.iter());
    let min_x = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let min_x = if min_x.is_finite() { min_x } else { 0.0 };
    let max_x = all().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let max_x = if max_x > min_x { max_x } else { min_x + 1.0 };
    let max_y = all().map(|p| p.1).fold(0.0f64, f64::max);
    let max_y = if max_y > 0.0 { max_y } else { 1.0 };
    let x = |v: f64| m + ((v - min_x) / (max_x - min_x)) * (w - 2.0 * m);
    let y = |v: f64| h - m - (v / max_y) * (h - 2.0 * m);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{m}\" y=\"20\" font-size=\"14\">{title}</text>\n\
         <line x1=\"{m}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{m}\" y=\"{lb}\">{min_x:.3}</text>\n\
         <text x=\"{r}\" y=\"{lb}\" text-anchor=\"end\">{x_label} {max_x:.3}</text>\n\
         <text x=\"5\" y=\"{top}\">{max_y:.3} {y_label}</text>\n",
        b = h - m,
        r = w - m,
        lb = h - m + 20.0,
        top = m - 5.0,
    );
    for (i, s) in series.iter().enumerate() {
        let pts = s
            .points
            .iter()
            .map(|&(px, py)| format!("{:.1},{:.1}", x(px), y(py)))
            .collect::<Vec<_>>()
            .join(" ");
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{pts}\"/>\n\
             <text x=\"{lx}\" y=\"40\" fill=\"{c}\">{n}</text>\n",
            c = s.color,
            n = s.name,
            lx = m + 10.0 + 120.0 * i as f64
        ));
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg).map_err(|source| strata::Error::Os {
        call: "write plot",
        source,
    })
}
