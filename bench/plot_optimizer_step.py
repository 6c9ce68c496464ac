"""One picture per model of the whole optimizer step against the Newton–Schulz floor.

Reads ``bench/results/optimizer_step_<model>.json`` (written by ``bench/optimizer_step.py``) and writes
``bench/results/optimizer_step_<model>.svg``: one horizontal bar per optimizer row (dtensor_muon.Muon,
torch.optim.Muon + AdamW, AdamW on everything) whose length is the median step time in ms on a linear axis,
and a vertical dashed line at the Newton–Schulz FLOP floor (``ns_floor_ms.syrk_ms``: the Muon matrices'
symmetric-product FLOPs at the 8192³ matmul rate measured in the same run). The title names the model, the
layers timed and the machine, versions, date and commit of the run.

    python bench/plot_optimizer_step.py                      # every optimizer_step_*.json with whole-step rows
    python bench/plot_optimizer_step.py bench/results/optimizer_step_llama3_8b.json

Standard library only: the SVG is written by hand.
"""

import json
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

RESULTS = Path(__file__).resolve().parent / "results"

LABELS = {
    "dtensor_muon": "dtensor_muon.Muon",
    "dtensor_muon_qk_clip": "dtensor_muon.Muon + QK-clip",
    "torch_muon_adamw": "torch.optim.Muon + AdamW",
    "adamw": "AdamW",
}
"""Bar labels by the row's ``key``; other rows are labelled with their ``optimizer`` field."""

MODEL_NAMES = {
    "llama3:8B": "Llama3-8B",
    "deepseek_v3:16B": "DeepSeek-V3-16B",
    "qwen3:30B-A3B": "Qwen3-30B-A3B",
    "deepseek_v3:kimi_k2": "Kimi K2",
}

COLORS = {"dtensor_muon": "#1f6fb4", "dtensor_muon_qk_clip": "#5b9bd5", "torch_muon_adamw": "#e08a2c"}
OTHER_COLOR = "#8c8c8c"
FLOOR_COLOR = "#c0392b"

WIDTH = 780
LEFT = 200  # the label column; the axis starts here
RIGHT = 170  # room for the value labels past the longest bar
TOP = 78
BAR = 26
GAP = 14
AXIS_SPACE = 46


def whole_step_rows(data: dict) -> list[dict]:
    """The rows of a whole-step run (each with ``step_ms``); empty for a ``--skip-whole`` run."""
    return [row for row in data.get("rows", []) if "step_ms" in row]


def nice_step(span: float) -> float:
    """A tick spacing of 1, 2 or 5 × 10^k giving about five ticks over ``span``."""
    raw = span / 5
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def title_lines(data: dict) -> tuple[str, str]:
    name = MODEL_NAMES.get(data.get("model"), data.get("model") or data.get("benchmark", "model"))
    what = f"{name}, first {data['layers']} layers" if data.get("layers") else name
    if data.get("experts"):
        what += f", {data['experts']} experts per MoE layer"
    machine = data.get("machine", {})
    run = ", ".join(
        part
        for part in (
            f"one {machine['device']}" if machine.get("device") else None,
            f"torch {machine['torch']}" if machine.get("torch") else None,
            f"Triton {machine['triton']}" if machine.get("triton") else None,
            machine.get("date"),
            f"commit {machine['commit']}" if machine.get("commit") else None,
        )
        if part
    )
    return f"{what}: one optimizer step (fp32, gradients given)", f"median of {data['args']['steps']} steps; {run}"


def draw(data: dict) -> str:
    """The SVG text of one run's picture. Bars have class ``bar`` and carry ``data-ms``; the floor line has
    class ``floor`` and carries ``data-ms``."""
    rows = whole_step_rows(data)
    if not rows:
        raise ValueError(f"{data.get('benchmark')}: no whole-step rows")
    floor = data["ns_floor_ms"]["syrk_ms"]
    span = max(floor, *(row["step_ms"] for row in rows))
    step = nice_step(span)
    top = math.ceil(span / step) * step
    scale = (WIDTH - LEFT - RIGHT) / top  # px per ms
    plot_bottom = TOP + len(rows) * (BAR + GAP)
    height = plot_bottom + AXIS_SPACE
    title, subtitle = title_lines(data)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
        f'<text x="10" y="38" fill="#444">{escape(subtitle)}</text>',
    ]
    ticks = [i * step for i in range(round(top / step) + 1)]
    for tick in ticks:
        x = LEFT + tick * scale
        out.append(f'<line x1="{x:.2f}" y1="{TOP - 6}" x2="{x:.2f}" y2="{plot_bottom}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{x:.2f}" y="{plot_bottom + 16}" text-anchor="middle">{tick:g}</text>')
    out.append(f'<line x1="{LEFT}" y1="{plot_bottom}" x2="{LEFT + top * scale:.2f}" y2="{plot_bottom}" stroke="#333"/>')
    out.append(
        f'<text x="{LEFT + top * scale / 2:.2f}" y="{plot_bottom + 36}" text-anchor="middle">'
        "step time, ms (linear axis)</text>"
    )
    values = []  # drawn last, over the floor line, on a white halo
    for i, row in enumerate(rows):
        y = TOP + i * (BAR + GAP)
        width = row["step_ms"] * scale
        label = LABELS.get(row.get("key"), row.get("optimizer", "?"))
        value = f"{row['step_ms']:.1f} ms"
        if row.get("vs_ns_floor") is not None:
            value += f" ({row['vs_ns_floor']:.2f}× floor)"
        bold = ' font-weight="bold"' if row.get("key") == "dtensor_muon" else ""
        out.append(f'<text x="{LEFT - 8}" y="{y + BAR / 2 + 4}" text-anchor="end"{bold}>{escape(label)}</text>')
        out.append(
            f'<rect class="bar" data-ms="{row["step_ms"]!r}" x="{LEFT}" y="{y}" width="{width:.4f}" height="{BAR}" '
            f'fill="{COLORS.get(row.get("key"), OTHER_COLOR)}"/>'
        )
        values.append(
            f'<text x="{LEFT + width + 6:.2f}" y="{y + BAR / 2 + 4}"{bold} stroke="white" stroke-width="4" '
            f'paint-order="stroke">{escape(value)}</text>'
        )
    x = LEFT + floor * scale
    out.append(
        f'<line class="floor" data-ms="{floor!r}" x1="{x:.4f}" y1="{TOP - 14}" x2="{x:.4f}" y2="{plot_bottom}" '
        f'stroke="{FLOOR_COLOR}" stroke-width="2" stroke-dasharray="6,4"/>'
    )
    out.append(
        f'<text x="{x:.2f}" y="{TOP - 18}" text-anchor="middle" fill="{FLOOR_COLOR}">'
        f"Newton–Schulz floor {floor:.1f} ms</text>"
    )
    out.extend(values)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plot(path: Path) -> Path | None:
    """Writes ``path`` with the suffix ``.svg``; None (nothing written) if the run has no whole-step rows."""
    data = json.loads(Path(path).read_text())
    if not whole_step_rows(data):
        return None
    out = Path(path).with_suffix(".svg")
    out.write_text(draw(data), encoding="utf-8")
    return out


def main(argv: list[str]) -> None:
    paths = [Path(p) for p in argv] or sorted(
        p for p in RESULTS.glob("optimizer_step_*.json") if not p.name.endswith("_shares.json")
    )
    for path in paths:
        out = plot(path)
        print(f"{path} -> {out}" if out else f"{path}: no whole-step rows, skipped")


if __name__ == "__main__":
    main(sys.argv[1:])
