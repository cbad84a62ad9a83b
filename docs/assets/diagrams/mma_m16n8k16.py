"""Draws mma_m16n8k16.svg, beside this file: which lane of a warp holds which element of the A, B
and C/D fragments of mma.sync.m16n8k16 with 16-bit inputs (PTX ISA, "Matrix Fragments for
mma.m16n8k16 with floating point type"). Run it again after changing it: python3 mma_m16n8k16.py
"""
from pathlib import Path

C = 21  # cell size
fills = ["hot", "warm", "cool", "red"]
out = []
def grid(x0, y0, rows, cols, cell, title, rowname, colname):
    out.append(f'<text x="{x0 + cols*C/2}" y="{y0-26}" text-anchor="middle" font-weight="bold">{title}</text>')
    out.append(f'<text class="small" x="{x0 + cols*C/2}" y="{y0-8}" text-anchor="middle">{colname} →</text>')
    out.append(f'<text class="small" x="{x0-8}" y="{y0 + rows*C/2}" text-anchor="middle" transform="rotate(-90 {x0-8} {y0 + rows*C/2})">{rowname} →</text>')
    for r in range(rows):
        for c in range(cols):
            lane, reg = cell(r, c)
            x, y = x0 + c*C, y0 + r*C
            out.append(f'<rect class="{fills[reg]}" x="{x}" y="{y}" width="{C}" height="{C}"/>'
                       f'<text class="mono" x="{x + C/2}" y="{y + C/2 + 3.5}" text-anchor="middle">{lane}</text>')
A = lambda r, c: ((r % 8) * 4 + (c % 8) // 2, (c // 8) * 2 + r // 8)
B = lambda k, n: (n * 4 + (k % 8) // 2, k // 8)
D = lambda r, c: ((r % 8) * 4 + c // 2, r // 8)
xA, xB, xD, y0 = 30, 30 + 16*C + 50, 30 + 24*C + 100, 50
grid(xA, y0, 16, 16, A, "A: 16 × 16 (row major)", "row m", "column k")
grid(xB, y0, 16, 8, B, "B: 16 × 8 (column major)", "row k", "column n")
grid(xD, y0, 16, 8, D, "C, D: 16 × 8 (fp32)", "row m", "column n")
out.append(f'<text x="{xA + 16*C + 25}" y="{y0 + 8*C + 5}" text-anchor="middle" font-size="16">×</text>')
out.append(f'<text x="{xB + 8*C + 22}" y="{y0 + 8*C + 5}" text-anchor="middle" font-size="16">→</text>')
H = y0 + 16*C + 70
legend = [("hot", "a[0] · b[0] · c[0], c[1]"), ("warm", "a[1] · b[1] · c[2], c[3]"), ("cool", "a[2]"), ("red", "a[3]")]
for i, (cls, text) in enumerate(legend):
    x = 30 + i * 200
    out.append(f'<rect class="{cls}" x="{x}" y="{H-40}" width="14" height="14"/><text x="{x+20}" y="{H-28}">{text}</text>')
W = xD + 8*C + 20
svg = (f'<svg class="fm-diagram" viewBox="0 0 {W} {H}" role="img" xmlns="http://www.w3.org/2000/svg" '
       'aria-label="Which lane of the warp holds which element of A, B and C in mma.sync.m16n8k16">\n'
       + "\n".join(out) + "\n</svg>")
Path(__file__).with_suffix(".svg").write_text(svg + "\n")
