"""Draws swizzle.svg, beside this file: where chunk c of rows 0..7 of a tile lands in shared memory,
without a swizzle and with stage 3's XOR swizzle (position = chunk ^ row % 8). One row of a D = 64
tile is 128 bytes: 8 chunks of 16 bytes, each covering 4 of the 32 banks. Run: python3 swizzle.py
"""
from pathlib import Path

C, TOP = 34, 58
out = []


def grid(x0, title, position_of):
    out.append(f'<text x="{x0 + 4 * C}" y="16" text-anchor="middle" font-weight="bold">{title}</text>')
    for p in range(8):
        out.append(f'<text class="small" x="{x0 + p * C + C / 2}" y="{TOP - 8}" text-anchor="middle">{4 * p}–{4 * p + 3}</text>')
    for row in range(8):
        out.append(f'<text class="small" x="{x0 - 8}" y="{TOP + row * C + C / 2 + 4}" text-anchor="end">row {row}</text>')
        for chunk in range(8):
            p = position_of(row, chunk)
            cls = "red" if chunk == 0 else "box"
            out.append(f'<rect class="{cls}" x="{x0 + p * C}" y="{TOP + row * C}" width="{C}" height="{C}"/>'
                       f'<text class="mono" x="{x0 + p * C + C / 2}" y="{TOP + row * C + C / 2 + 4}" text-anchor="middle">{chunk}</text>')


grid(70, "row-major: chunk c at position c", lambda row, chunk: chunk)
grid(70 + 8 * C + 110, "swizzled: chunk c at position c ^ row", lambda row, chunk: chunk ^ row % 8)
W, H = 70 + 16 * C + 130, TOP + 8 * C + 30
out.append(f'<text class="small" x="70" y="{TOP - 26}">banks of each 16-byte position:</text>')
out.append(f'<text class="small" x="{W / 2}" y="{H - 8}" text-anchor="middle">ldmatrix reads chunk 0 (red) of rows 0–7 at once: '
           'on the left all 8 are in banks 0–3 (8-way conflict), on the right in 8 different groups of banks</text>')
svg = (f'<svg class="fm-diagram" viewBox="0 0 {W} {H}" role="img" xmlns="http://www.w3.org/2000/svg" '
       'aria-label="An XOR swizzle spreads the same chunk of 8 rows over all the banks">\n' + "\n".join(out) + "\n</svg>")
Path(__file__).with_suffix(".svg").write_text(svg + "\n")
