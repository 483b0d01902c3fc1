"""The Jinja environment over ``purlinc.templates``: strict (a missing value is an error) and
formatting only; template errors are InternalErrors (bugs in purlinc, not in the input)."""

from __future__ import annotations

from functools import lru_cache

import jinja2

from purlinc.errors import InternalError
from purlinc.resources import templates_dir


def load_template(name: str) -> str:
    return (templates_dir() / name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: load_template(name)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(name: str, **values) -> str:
    try:
        return environment().get_template(name).render(**values)
    # Bugs, not the user's input (exit 3 with a command that reproduces them, not 2)
    except jinja2.TemplateSyntaxError as error:
        raise InternalError(f"template {error.name or name}:{error.lineno}: {error.message} "
                            "(the code generator's templates are broken)") from None
    except jinja2.UndefinedError as error:
        raise InternalError(f"template {name}: {error.message} (the code generator passed the template "
                            "too little)") from None
