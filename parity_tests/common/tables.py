"""Plain-text tables shared by every verb of the command line."""


def format_table(headers, rows):
    """Left-aligned columns, a rule under the header; cells are turned into str."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    def line(row):
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)
