"""A dependency-free PNG stacked-bar chart of a profile's categories."""
from __future__ import annotations

import math
import struct
import zlib

from kimi_jax.tools.hlo import CATEGORIES

COLORS = {
    "all-reduce": (214, 39, 40),
    "all-gather": (255, 127, 14),
    "reduce-scatter": (188, 189, 34),
    "all-to-all": (148, 103, 189),
    "collective-permute": (140, 86, 75),
    "matmul": (31, 119, 180),
    "attention": (44, 160, 44),
    "rest": (127, 127, 127),
}

# 5x7 bitmap glyphs, one string of 7 rows of 5 bits each
_FONT = {
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110",
    "9": "01110 10001 10001 01111 00001 00010 01100",
    "A": "01110 10001 10001 11111 10001 10001 10001",
    "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110",
    "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111",
    "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111",
    "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110",
    "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001",
    "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001",
    "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110",
    "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101",
    "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110",
    "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110",
    "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010",
    "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100",
    "Z": "11111 00001 00010 00100 01000 10000 11111",
    " ": "00000 00000 00000 00000 00000 00000 00000",
    ".": "00000 00000 00000 00000 00000 01100 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000",
    "%": "11000 11001 00010 00100 01000 10011 00011",
    ":": "00000 01100 01100 00000 01100 01100 00000",
    "/": "00001 00001 00010 00100 01000 10000 10000",
    "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000",
    "+": "00000 00100 00100 11111 00100 00100 00000",
    "=": "00000 00000 11111 00000 11111 00000 00000",
    ",": "00000 00000 00000 00000 01100 00100 01000",
    "_": "00000 00000 00000 00000 00000 00000 11111",
}


class _Canvas:
    def __init__(self, w, h, bg=(255, 255, 255)):
        self.w, self.h = w, h
        self.px = bytearray(bytes(bg) * (w * h))

    def rect(self, x0, y0, x1, y1, color):
        x0, x1 = max(0, int(x0)), min(self.w, int(x1))
        y0, y1 = max(0, int(y0)), min(self.h, int(y1))
        row = bytes(color) * max(0, x1 - x0)
        for y in range(y0, y1):
            i = (y * self.w + x0) * 3
            self.px[i:i + len(row)] = row

    def text(self, x, y, s, color=(0, 0, 0), scale=2):
        for ch in s.upper():
            g = _FONT.get(ch, _FONT[" "])
            for r, bits in enumerate(g.split()):
                for c, b in enumerate(bits):
                    if b == "1":
                        self.rect(
                            x + c * scale,
                            y + r * scale,
                            x + (c + 1) * scale,
                            y + (r + 1) * scale,
                            color,
                        )
            x += 6 * scale
        return x

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.px[y * self.w * 3 : (y + 1) * self.w * 3]) for y in range(self.h)
        )

        def chunk(tag, data):
            return (
                struct.pack(">I", len(data))
                + tag
                + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
            )

        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def stacked_bar_png(
    bars: list[tuple[str, dict[str, float]]], title: str, unit: str = "MS"
) -> bytes:
    """A stacked-bar chart: a bar per (label, {category: value}), categories in CATEGORIES order."""
    W, H, left, top, bottom = 960, 520, 80, 56, 60
    legend_w = 250
    plot_w = W - left - legend_w - 20
    plot_h = H - top - bottom
    cv = _Canvas(W, H)
    cv.text(left, 6, title[:60], scale=2)
    vmax = max([sum(v.values()) for _, v in bars] + [1e-9])
    mag = 10 ** math.floor(math.log10(vmax))
    ymax = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= vmax)
    cv.rect(left - 2, top, left, top + plot_h, (0, 0, 0))
    cv.rect(left - 2, top + plot_h, left + plot_w, top + plot_h + 2, (0, 0, 0))
    for k in range(5):
        v = ymax * k / 4
        y = top + plot_h - plot_h * k / 4
        cv.rect(left - 6, y, left - 2, y + 1, (0, 0, 0))
        cv.text(4, y - 7, f"{v:.3g}", scale=2)
    cv.text(4, top - 30, unit, scale=2)
    n = max(len(bars), 1)
    slot = plot_w / n
    bw = max(4, min(80, slot * 0.7))
    for i, (label, vals) in enumerate(bars):
        x0 = left + slot * i + (slot - bw) / 2
        y = top + plot_h
        for c in CATEGORIES:
            h = plot_h * vals.get(c, 0.0) / ymax
            if h > 0:
                cv.rect(x0, y - h, x0 + bw, y, COLORS[c])
                y -= h
        cv.text(x0, top + plot_h + 8, label[:6], scale=2 if n <= 12 else 1)
    lx = W - legend_w
    for j, c in enumerate(reversed(CATEGORIES)):
        yy = top + 24 * j
        cv.rect(lx, yy, lx + 16, yy + 16, COLORS[c])
        cv.text(lx + 24, yy + 1, c, scale=2)
    return cv.png()


def write_png_chart(report, path: str) -> str:
    """The stacked bars of a ProfileReport's traced steps and their mean, written to `path`."""
    bars = [(f"S{i}", s) for i, s in enumerate(report.per_step_ms)] + [("MEAN", report.ms_per_step)]
    title = f"{report.layout} B{report.batch} CTX{report.context} {report.backend}"
    with open(path, "wb") as f:
        f.write(stacked_bar_png(bars, title, unit="MS/STEP"))
    return path


def read_png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    return struct.unpack(">II", head[16:24])
