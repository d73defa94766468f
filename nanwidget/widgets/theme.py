"""Colours and layout rules of the FrameBrowser, from the JupyterLab theme's CSS variables.

One stylesheet, shipped inside the widget (and inside its static copy): the alert colour is
JupyterLab's dark error red on light themes and its light error red on dark ones, both over a
faint red tint, so that text keeps a contrast of at least 4.5:1 (WCAG AA) in either theme.
Every variable has a fallback for pages that do not define JupyterLab's (nbconvert, VS Code).

The plots are drawn once, dark on a transparent background; on a dark theme the page turns
them light (``filter: invert(1) hue-rotate(180deg)`` keeps each colour's hue and swaps its
lightness), so they sit on the theme's own background without a second drawing. The static
copy's pictures carry a white background inline: where a sanitizer strips the stylesheet, they
stay dark on white.
"""

from __future__ import annotations

__all__ = ["STYLESHEET", "ALERT", "MUTED", "WARNING", "NONFINITE_ROW", "NEAR_LIMIT_ROW",
           "PLOT_IMAGE"]

# Inline styles that still read well where the stylesheet is stripped (e.g. a sanitizer).
ALERT = "color:var(--nw-alert-fg,#b00000)"
MUTED = "color:var(--nw-muted,#666)"
# An early warning: the orange of the history plot's warning rings, readable on both themes.
WARNING = "color:var(--nw-warning-fg,#a64b00)"
NONFINITE_ROW = "background:var(--nw-alert-bg,#ffd6d6);color:var(--nw-alert-fg,#8b0000);font-weight:bold"
NEAR_LIMIT_ROW = "background:var(--nw-near-bg,#fff1c2)"

_DARK = ('body[data-jp-theme-light="false"] {0}, body.vscode-dark {0}, '
         'body.vscode-high-contrast {0}')
_SCOPE = ".nw-browser, .nw-static"
PLOT_IMAGE = "nw-plot-image"  # the class of every plot picture (live and static)
_PLOTS = f".nw-browser .{PLOT_IMAGE}"
_STATIC_PLOTS = f".nw-static .{PLOT_IMAGE}"

STYLESHEET = f"""
<style>
{_SCOPE} {{
  --nw-alert-fg: var(--jp-error-color0, #b71c1c);
  --nw-alert-bg: rgba(244, 67, 54, 0.12);
  --nw-near-bg: rgba(255, 152, 0, 0.20);
  --nw-muted: var(--jp-content-font-color2, #666);
  --nw-marker: rgba(255, 152, 0, 0.30);
  --nw-marker-edge: #e65100;
  --nw-warning-fg: #a64b00;
}}
{_DARK.format('.nw-browser')}, {_DARK.format('.nw-static')} {{
  --nw-alert-fg: var(--jp-error-color2, #e57373);
  --nw-alert-bg: rgba(244, 67, 54, 0.15);
  --nw-near-bg: rgba(255, 183, 77, 0.22);
  --nw-marker-edge: #ffb74d;
  --nw-warning-fg: #ffb74d;
}}
{_DARK.format(_PLOTS)}, {_DARK.format(_STATIC_PLOTS)} {{
  filter: invert(1) hue-rotate(180deg); background: transparent !important;
}}
.nw-alert {{ color: var(--nw-alert-fg); background: var(--nw-alert-bg); padding: 0 3px;
  border-radius: 2px; }}
.nw-muted {{ color: var(--nw-muted); }}
.nw-browser .nw-table td, .nw-browser .nw-table th, .nw-static .nw-table td,
.nw-static .nw-table th {{ padding: 1px 8px; font-family: var(--jp-code-font-family, monospace);
  font-size: 12px; line-height: 1.35; }}
.nw-browser .nw-frame-table {{ max-height: 290px; overflow: auto; }}
.nw-browser .nw-status .widget-html-content, .nw-browser .nw-trace-head {{ line-height: 1.45; }}
.nw-browser .nw-frame-head {{ margin: 2px 0 4px 0; }}
.nw-browser .nw-plot-stack {{ position: relative; }}
.nw-browser .nw-marker-layer, .nw-browser .nw-marker-layer > .widget-html-content {{
  height: 100%; width: 100%; margin: 0; padding: 0; position: relative;
  pointer-events: none; }}
.nw-marker {{ position: absolute; background: var(--nw-marker);
  border-left: 1px solid var(--nw-marker-edge); border-right: 1px solid var(--nw-marker-edge);
  box-sizing: border-box; pointer-events: none; }}
.nw-browser .widget-image {{ max-width: 100%; }}
.nw-browser .nw-frame-label {{ white-space: nowrap; font-size: 12px; margin: 0 2px; }}
.nw-browser .nw-filter-layer.nw-invalid input {{ border-color: var(--nw-alert-fg); }}
.nw-browser .nw-export-link a {{ font-weight: bold; }}
.nw-browser .nw-trace pre {{ line-height: 1.3; max-height: 260px; overflow: auto;
  font-size: 11px; white-space: pre-wrap; word-break: normal; overflow-wrap: break-word; }}
</style>
"""
