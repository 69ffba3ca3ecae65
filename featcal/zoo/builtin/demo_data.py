"""Synthetic image tasks for the embedded demo zoo, generated offline in numpy.

Every task is a pure function of a seed: ``make_task(name, n, seed)`` returns
``(images, labels)`` with images ``(n, 32, 32, 3)`` uint8 and labels ``(n,)``
int64, and the same seed always gives the same arrays. Each image draws its
colours and geometry from continuous ranges, so two independently drawn
images are rarely byte-identical; :func:`drop_duplicates` removes the
exceptions so that test images never occur in a train split.

Tasks (classes):
    digits       scikit-learn's 8x8 digits, upscaled, random colour and shift (10)
    letters      A-J drawn with Pillow's default font, size and rotation jitter (10)
    shapes       circle, square, triangle, cross, star, ring, bar, half-disc (8)
    colour       a blob whose hue falls in one of 8 bins (8)
    count        1-6 dots (6)
    position     a blob in one cell of a 3x3 grid (9)
    orientation  a line at one of 8 angles (8)

``digits`` draws its source images from disjoint pools for train (1,497
digits) and test (300 digits), so test digits are unseen handwriting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SIZE = 32
_DIGITS_TEST_POOL = 300  # source digits reserved for the test split


@dataclass(frozen=True)
class TaskSpec:
    name: str
    classes: tuple[str, ...]
    draw: Callable[[ImageDraw.ImageDraw, int, np.random.Generator, tuple], None] | None


# ---------------------------------------------------------------- primitives

# Each task has its own palette (its "domain"), as real benchmarks do (digits on
# street signs, satellite scenes, textures): (foreground centre, background
# centre, jitter). None as a foreground centre: any saturated colour.
PALETTES: dict[str, tuple[tuple | None, tuple, int]] = {
    "digits": ((235, 225, 160), (25, 35, 90), 25),  # pale yellow on navy
    "letters": ((40, 30, 30), (235, 230, 215), 25),  # dark ink on paper
    "shapes": (None, (60, 60, 60), 20),  # any bright colour on dark grey
    "colour": (None, (15, 15, 15), 12),  # the hue is the label, on black
    "count": ((245, 245, 245), (40, 120, 50), 20),  # white dots on green
    "position": ((170, 30, 30), (245, 245, 250), 20),  # a red blob on white
    "orientation": ((20, 20, 60), (215, 160, 90), 25),  # a dark line on sand
}


def _jitter(centre: tuple, amount: int, rng: np.random.Generator) -> tuple:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in centre)


def _colours(task: str, rng: np.random.Generator) -> tuple[tuple, tuple]:
    """A (foreground, background) pair from the task's palette."""
    fg, bg, amount = PALETTES[task]
    fg = (
        _hsv_to_rgb(rng.random(), rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0))
        if fg is None
        else _jitter(fg, amount, rng)
    )
    return fg, _jitter(bg, amount, rng)


def _finish(img: Image.Image, rng: np.random.Generator, noise: float) -> np.ndarray:
    """Add pixel noise (if any) and return a (32, 32, 3) uint8 array."""
    arr = np.asarray(img, dtype=np.float32)
    if noise > 0:
        arr = arr + rng.normal(0.0, noise, arr.shape)
    return np.clip(arr, 0, 255).astype(np.uint8)


def _polygon(cx: float, cy: float, r: float, k: int, phase: float) -> list[tuple[float, float]]:
    return [
        (cx + r * math.cos(phase + 2 * math.pi * i / k), cy + r * math.sin(phase + 2 * math.pi * i / k))
        for i in range(k)
    ]


def _blob(draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, fill: tuple, rng: np.random.Generator) -> None:
    """A filled ellipse or rectangle (random) centred at (cx, cy)."""
    box = [cx - r, cy - r, cx + r, cy + r]
    if rng.random() < 0.5:
        draw.ellipse(box, fill=fill)
    else:
        draw.rectangle(box, fill=fill)


# ---------------------------------------------------------------- tasks

SHAPES = ("circle", "square", "triangle", "cross", "star", "ring", "bar", "half-disc")


def _draw_shape(draw, label, rng, colours):
    fg, bg = colours
    r = rng.uniform(9, 12)
    cx, cy = rng.uniform(r + 1, SIZE - r - 1, 2)
    phase = rng.uniform(-0.2, 0.2)
    name = SHAPES[label]
    if name == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif name == "square":
        draw.polygon(_polygon(cx, cy, r * 1.2, 4, math.pi / 4 + phase), fill=fg)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, r * 1.15, 3, -math.pi / 2 + phase), fill=fg)
    elif name == "cross":
        w = r / 3
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fg)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fg)
    elif name == "star":
        pts = []
        for i in range(10):
            rr = r * 1.2 if i % 2 == 0 else r * 0.5
            a = -math.pi / 2 + phase + math.pi * i / 5
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        draw.polygon(pts, fill=fg)
    elif name == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
        ri = r * 0.55
        draw.ellipse([cx - ri, cy - ri, cx + ri, cy + ri], fill=bg)
    elif name == "bar":
        w = r / 3
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fg)
    else:  # half-disc, flat side down
        draw.pieslice([cx - r, cy - r * 0.5, cx + r, cy + r * 1.5], 180, 360, fill=fg)


HUES = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink")


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[int, int, int]:
    i = int(h * 6) % 6
    f = h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return tuple(int(255 * c) for c in rgb)


def _colour_bins(label: int, rng: np.random.Generator) -> float:
    """A hue in bin ``label`` of 8 equal bins (with a margin between bins)."""
    return ((label + rng.uniform(0.15, 0.85)) / len(HUES)) % 1.0


def _draw_colour(draw, label, rng, colours):
    hue = _colour_bins(label, rng)
    fill = _hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0))
    r = rng.uniform(6, 12)
    cx, cy = rng.uniform(r, SIZE - r, 2)
    _blob(draw, cx, cy, r, fill, rng)


def _draw_count(draw, label, rng, colours):
    fg, _ = colours
    n = label + 1
    placed: list[tuple[float, float]] = []
    r = rng.uniform(2.0, 3.0)
    while len(placed) < n:
        x, y = rng.uniform(r + 1, SIZE - r - 1, 2)
        if all((x - a) ** 2 + (y - b) ** 2 > (2 * r + 2) ** 2 for a, b in placed):
            placed.append((x, y))
    for x, y in placed:
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fg)


def _draw_position(draw, label, rng, colours):
    fg, _ = colours
    row, col = divmod(label, 3)
    cell = SIZE / 3
    r = rng.uniform(2.5, 4.0)
    cx = (col + rng.uniform(0.3, 0.7)) * cell
    cy = (row + rng.uniform(0.3, 0.7)) * cell
    _blob(draw, cx, cy, r, fg, rng)


ANGLES = tuple(f"{a:g}deg" for a in np.arange(8) * 22.5)


def _draw_orientation(draw, label, rng, colours):
    fg, _ = colours
    a = math.radians(label * 22.5 + rng.uniform(-5, 5))
    cx, cy = rng.uniform(12, 20, 2)
    half = rng.uniform(9, 14)
    dx, dy = half * math.cos(a), -half * math.sin(a)
    draw.line([cx - dx, cy - dy, cx + dx, cy + dy], fill=fg, width=int(rng.integers(2, 4)))


LETTERS = tuple("ABCDEFGHIJ")
_FONTS: dict[int, ImageFont.ImageFont] = {}


def _font(size: int):
    if size not in _FONTS:
        _FONTS[size] = ImageFont.load_default(size=size)
    return _FONTS[size]


def _letter(label: int, rng: np.random.Generator, colours) -> Image.Image:
    fg, bg = colours
    glyph = Image.new("L", (SIZE, SIZE), 0)
    d = ImageDraw.Draw(glyph)
    size = int(rng.integers(20, 27))
    d.text((SIZE / 2, SIZE / 2), LETTERS[label], fill=255, font=_font(size), anchor="mm")
    glyph = glyph.rotate(rng.uniform(-8, 8), resample=Image.BILINEAR, translate=tuple(rng.uniform(-2, 2, 2)))
    return Image.composite(Image.new("RGB", (SIZE, SIZE), fg), Image.new("RGB", (SIZE, SIZE), bg), glyph)


_DIGITS: tuple[np.ndarray, np.ndarray] | None = None


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (1797, 8, 8) floats in [0, 1] and labels, loaded once."""
    global _DIGITS
    if _DIGITS is None:
        from sklearn.datasets import load_digits

        d = load_digits()
        _DIGITS = (d.images.astype(np.float32) / 16.0, d.target.astype(np.int64))
    return _DIGITS


def _digit_pool(part: str) -> np.ndarray:
    """Indices of the source digits used by ``part`` (``train`` or ``test``): disjoint, fixed."""
    n = len(_digits()[1])
    perm = np.random.default_rng(12345).permutation(n)
    return perm[:_DIGITS_TEST_POOL] if part == "test" else perm[_DIGITS_TEST_POOL:]


def _digit(src: np.ndarray, rng: np.random.Generator, colours) -> Image.Image:
    fg, bg = colours
    side = int(rng.integers(22, 27))
    mask = Image.fromarray((src * 255).astype(np.uint8)).resize((side, side), Image.BILINEAR)
    canvas = Image.new("L", (SIZE, SIZE), 0)
    off = (SIZE - side) // 2
    dx, dy = rng.integers(-1, 2, 2)
    canvas.paste(mask, (int(off + dx), int(off + dy)))
    return Image.composite(Image.new("RGB", (SIZE, SIZE), fg), Image.new("RGB", (SIZE, SIZE), bg), canvas)


TASKS: dict[str, TaskSpec] = {
    "digits": TaskSpec("digits", tuple(str(i) for i in range(10)), None),
    "letters": TaskSpec("letters", LETTERS, None),
    "shapes": TaskSpec("shapes", SHAPES, _draw_shape),
    "colour": TaskSpec("colour", HUES, _draw_colour),
    "count": TaskSpec("count", tuple(str(i) for i in range(1, 7)), _draw_count),
    "position": TaskSpec("position", tuple(f"r{r}c{c}" for r in range(3) for c in range(3)), _draw_position),
    "orientation": TaskSpec("orientation", ANGLES, _draw_orientation),
}


def make_task(name: str, n: int, seed: int, part: str = "train", noise: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images of task ``name`` with balanced random labels.

    Returns ``(images, labels)``: ``(n, 32, 32, 3)`` uint8 and ``(n,)`` int64.
    ``part`` (``train`` or ``test``) only matters for ``digits``, whose source
    handwriting is split into disjoint pools. ``noise`` is the standard deviation
    of Gaussian pixel noise (0: none; noise makes the images incompressible).
    """
    if name not in TASKS:
        raise KeyError(f"unknown demo task {name!r}; choose from {sorted(TASKS)}.")
    spec = TASKS[name]
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % len(spec.classes)).astype(np.int64)
    images = np.empty((n, SIZE, SIZE, 3), dtype=np.uint8)
    if name == "digits":
        src_x, src_y = _digits()
        pool = _digit_pool(part)
        by_class = {c: pool[src_y[pool] == c] for c in range(10)}
    for i, label in enumerate(labels):
        colours = _colours(name, rng)
        if name == "digits":
            img = _digit(src_x[rng.choice(by_class[int(label)])], rng, colours)
        elif name == "letters":
            img = _letter(int(label), rng, colours)
        else:
            img = Image.new("RGB", (SIZE, SIZE), colours[1])
            spec.draw(ImageDraw.Draw(img), int(label), rng, colours)
        images[i] = _finish(img, rng, noise)
    return images, labels


def drop_duplicates(x: np.ndarray, y: np.ndarray, against: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop the rows of ``x`` (and ``y``) whose bytes equal a row of ``against``."""
    seen = {row.tobytes() for row in against}
    keep = np.array([row.tobytes() not in seen for row in x], dtype=bool)
    return x[keep], y[keep]
