//! A terminal frame as an SVG image (the README's `strata top` screenshot): one `<text>` per
//! line, one `<tspan>` per run of cells with one style, each at its column.

use ratatui::buffer::Buffer;
use ratatui::style::Modifier;

use super::color;

const CELL_W: f64 = 8.4;
const CELL_H: f64 = 17.0;
const BACKGROUND: &str = "#282c34";
const FOREGROUND: &str = "#dcdfe4";

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

pub fn render(buffer: &Buffer) -> String {
    let (w, h) = (buffer.area.width, buffer.area.height);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0}\" height=\"{:.0}\" \
         font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\" font-size=\"14\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"{BACKGROUND}\"/>\n",
        f64::from(w) * CELL_W + 16.0,
        f64::from(h) * CELL_H + 16.0
    );
    for y in 0..h {
        let baseline = 8.0 + f64::from(y) * CELL_H + CELL_H * 0.75;
        let mut line = format!("<text y=\"{baseline:.1}\" xml:space=\"preserve\">");
        let mut x = 0;
        while x < w {
            let first = &buffer[(x, y)];
            let reversed = first.modifier.contains(Modifier::REVERSED);
            let bold = first.modifier.contains(Modifier::BOLD);
            let (fg, bg) = (first.fg, first.bg);
            let start = x;
            let mut text = String::new();
            while x < w {
                let c = &buffer[(x, y)];
                if c.fg != fg || c.bg != bg || c.modifier != first.modifier {
                    break;
                }
                text.push_str(c.symbol());
                x += 1;
            }
            let (mut fill, back) = (color(fg, FOREGROUND), color(bg, BACKGROUND));
            if reversed {
                fill = back;
                let left = 8.0 + f64::from(start) * CELL_W;
                let width = f64::from(x - start) * CELL_W;
                let top = 8.0 + f64::from(y) * CELL_H;
                svg.push_str(&format!(
                    "<rect x=\"{left:.1}\" y=\"{top:.1}\" width=\"{width:.1}\" height=\"{CELL_H}\" \
                     fill=\"{}\"/>\n",
                    color(fg, FOREGROUND)
                ));
            }
            if text.trim().is_empty() {
                continue;
            }
            let weight = if bold { " font-weight=\"bold\"" } else { "" };
            // Each run spans exactly its cells, whatever widths the font's glyphs have.
            line.push_str(&format!(
                "<tspan x=\"{:.1}\" textLength=\"{:.1}\" lengthAdjust=\"spacingAndGlyphs\" \
                 fill=\"{fill}\"{weight}>{}</tspan>",
                8.0 + f64::from(start) * CELL_W,
                f64::from(x - start) * CELL_W,
                escape(&text)
            ));
        }
        line.push_str("</text>\n");
        svg.push_str(&line);
    }
    svg.push_str("</svg>\n");
    svg
}
