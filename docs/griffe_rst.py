"""Griffe extension for the API pages: render the reST idioms of the docstrings as Markdown.

The docstrings follow the Google style, with a few reST idioms that read well in ``help()``:
roles (``:class:`~torch.optim.Optimizer```), double-backquoted literals, ``.. warning::``
blocks and ``Example::`` literal blocks. Without this, mkdocstrings shows them verbatim.
Roles and literals become code spans, directives become admonitions. Only the rendered
pages change; the source docstrings are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+?)``")
_DIRECTIVE = re.compile(r"^([ \t]*)\.\. (warning|note|seealso|important|tip)::[ \t]*(.*)$", re.M)
_LITERAL_BLOCK = re.compile(r"^(\s*)([A-Z][\w ]*)::\s*$", re.M)
_TRAILING_LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)


def _admonition(m: re.Match) -> str:
    indent, kind, inline = m.group(1), m.group(2), m.group(3).strip()
    head = f"{indent}!!! {'info' if kind == 'seealso' else kind}"
    # ".. warning:: text" on one line: the text becomes the admonition's indented body.
    return f"{head}\n{indent}    {inline}" if inline else head


def rst_to_markdown(text: str) -> str:
    """Return ``text`` with reST roles, literals, directives and ``Name::`` blocks as Markdown."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = _LITERAL.sub(lambda m: f"`{m.group(1)}`", text)
    text = _DIRECTIVE.sub(_admonition, text)
    # "Example::" (a literal block in reST) is a Google "Examples:" section when doctest lines follow,
    # else a plain paragraph ending in ":" whose indented block Markdown renders as code.
    text = _LITERAL_BLOCK.sub(
        lambda m: f"{m.group(1)}{'Examples' if m.group(2) in ('Example', 'Examples') else m.group(2)}:", text
    )
    # "... the config::" before an indented block: the block is code in Markdown as it is.
    return _TRAILING_LITERAL.sub(lambda m: f"{m.group(1)}:", text)


class RstToMarkdown(griffe.Extension):
    """Rewrite every docstring with :func:`rst_to_markdown` as it is loaded."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
