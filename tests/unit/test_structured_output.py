"""StructuredOutput as plain data: checked where params are built, carried unchanged between a
node's front and its core, and refused by name when malformed."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import StructuredOutput
from pdserve.node.messages import StreamSubmit, decode, encode


def test_params_with_a_constraint_cross_the_front_core_codec_unchanged():
    params = SamplingParams(temperature=0, structured_output=StructuredOutput.choice(["a", "b\"c"]))
    msg = decode(encode(StreamSubmit("r1", [1, 2], params, 0)))
    assert msg.params == params and hash(msg.params) == hash(params)
    assert msg.params.structured_output == StructuredOutput("choice", '["a", "b\\"c"]')


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^structured_output.kind must be one of \['choice', 'grammar', "
                                         r"'json_object', 'json_schema', 'regex'\], got 'xml'$"):
        StructuredOutput("xml", "<a/>")


def test_a_spec_that_is_not_text_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^structured_output.regex must be a str, got int$"):
        StructuredOutput("regex", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^structured_output.choice must be a list of str$"):
        StructuredOutput.choice(["a", 1])  # type: ignore[list-item]
