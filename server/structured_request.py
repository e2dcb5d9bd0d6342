"""The output constraint a request asks for, as one GrammarSpec: OpenAI's `response_format`,
vLLM's `structured_outputs` extension, or vLLM's older `guided_*` fields. At most one
may be given; tool calls (server/tools.py) bring their own."""

from __future__ import annotations

import json
from typing import Any

from graphserve.engine.structured.grammar import GrammarSpec
from graphserve.server.errors import bad_request
from graphserve.server.protocol import _SamplingFields


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request("the JSON schema is not valid JSON", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request("a JSON schema must be an object", param=param)
    return json.dumps(schema)


def grammar_from_request(body: _SamplingFields) -> GrammarSpec | None:
    """The request's output constraint, or None for free text. Raises a 400 naming the
    field for a malformed or ambiguous one (the grammar itself is checked when compiled)."""
    found: list[GrammarSpec] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(GrammarSpec("json_object", param="response_format"))
        else:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  param="response_format.json_schema")
            found.append(GrammarSpec("json_schema", _schema_text(fmt.json_schema.json_schema, "response_format"),
                                     param="response_format"))
    so = body.structured_outputs
    if so is not None:
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(so, name) not in (None, False)]
        if len(given) != 1:
            raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                              "structural_tag", param="structured_outputs")
        found.append(_extension(given[0].rstrip("_"), getattr(so, given[0]), "structured_outputs"))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append(_extension(kind, value, name))
    if len(found) > 1:
        raise bad_request("give at most one of response_format, structured_outputs and guided_*",
                          param=found[1].param)
    return found[0] if found else None


def _extension(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec("json_schema", _schema_text(value, param), param=param)
    if kind == "json_object":
        return GrammarSpec("json_object", param=param)
    if kind == "choice":
        if not all(isinstance(c, str) and c for c in value):
            raise bad_request("choice must be a list of non-empty strings", param=param)
        return GrammarSpec("choice", json.dumps(value), param=param)
    return GrammarSpec(kind, value, param=param)  # regex, grammar, structural_tag: text
