"""mkdocs hook: the CLI reference is generated from the argparse parser at build time, so it
cannot go stale. A page containing ``<!-- cli-reference -->`` gets every command's --help."""

import io
from contextlib import redirect_stdout


def _help(parser) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        parser.print_help()
    return buf.getvalue()


def on_page_markdown(markdown, page, config, files):
    if "<!-- cli-reference -->" not in markdown:
        return markdown
    from hf_ckpt_integrations import cli

    parser = cli.build_parser()
    parts = [f"```text\n{_help(parser)}```\n"]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        parts.append(f"## `hf-ckpt {name}`\n\n```text\n{_help(p)}```\n")
    return markdown.replace("<!-- cli-reference -->", "\n".join(parts))
