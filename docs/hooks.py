"""mkdocs hook: generated parts of pages, so they cannot go stale. A page containing
``<!-- cli-reference -->`` gets every command's --help (from the argparse parser); one containing
``<!-- supported-inputs -->`` the table of input kinds (``hf_ckpt_integrations.supported_inputs``,
which ``--help`` and README.md use too)."""

import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)


def _checkout_first():
    """Import the checkout this site documents, not whichever copy the venv installed (mkdocs resets
    sys.path after loading hooks, so this runs at each use)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)


def _help(parser) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        parser.print_help()
    return buf.getvalue()


def on_page_markdown(markdown, page, config, files):
    _checkout_first()
    if "<!-- supported-inputs -->" in markdown:
        from hf_ckpt_integrations.supported_inputs import markdown_table

        prefix = "../" * page.file.src_uri.count("/")  # links relative to this page
        markdown = markdown.replace("<!-- supported-inputs -->", markdown_table(prefix))
    if "<!-- cli-reference -->" not in markdown:
        return markdown
    from hf_ckpt_integrations import cli

    parser = cli.build_parser()
    parts = [f"```text\n{_help(parser)}```\n"]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        parts.append(f"## `hf-ckpt {name}`\n\n```text\n{_help(p)}```\n")
    return markdown.replace("<!-- cli-reference -->", "\n".join(parts))
