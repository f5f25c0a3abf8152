"""Trace readers: every supported format, format detection, and one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from rose.sim.traces import TraceError, load_trace, parse_trace


@pytest.mark.parametrize(
    "name,fmt,rows",
    [
        ("azure_llm2023_conv.csv", "azure", 19366),
        ("azure_llm2023_code.csv", "azure", 8819),  # no trailing newline
        ("burstgpt1_first400.csv", "burstgpt", 400 - 17),  # 17 failed (zero-token) rows dropped
        ("burstgpt3_first400.csv", "burstgpt", 400 - 1),
        ("mooncake_fast25_synthetic.jsonl", "mooncake", 3993),
    ],
)
def test_real_traces(traces_dir, name, fmt, rows):
    tr = load_trace(traces_dir / name)
    assert tr.fmt == fmt and len(tr) == rows and tr.name == name
    assert tr.arrival_s[0] == 0.0 and np.all(np.diff(tr.arrival_s) >= 0)
    assert tr.prompt_tokens.dtype == np.int32 and tr.output_tokens.dtype == np.int32
    assert np.all(tr.prompt_tokens >= 0) and np.all(tr.output_tokens >= 0)
    if fmt == "burstgpt":
        assert not np.any((tr.prompt_tokens == 0) & (tr.output_tokens == 0))


def test_azure_values_and_duration(traces_dir):
    tr = load_trace(traces_dir / "azure_llm2023_conv.csv")
    # first rows: 18:15:46.6805900,374,44 then 18:15:50.9951690,396,109
    assert tr.prompt_tokens[:2].tolist() == [374, 396] and tr.output_tokens[:2].tolist() == [44, 109]
    assert tr.arrival_s[1] == pytest.approx(4.314579, abs=1e-6)
    # 18:15:46.68 to 19:14:08.xx
    assert 3500 < tr.duration_s < 3505
    assert tr.scaled(10).duration_s == pytest.approx(tr.duration_s / 10)
    assert len(tr.until(60.0)) == int(np.sum(tr.arrival_s < 60.0))


def test_mooncake_ms_and_burstgpt3_offset(traces_dir):
    mc = load_trace(traces_dir / "mooncake_fast25_synthetic.jsonl")
    assert mc.duration_s == pytest.approx(1022.025)
    b3 = load_trace(traces_dir / "burstgpt3_first400.csv")
    assert b3.prompt_tokens[0] == 906 and b3.arrival_s[1] == pytest.approx(51.0)


AZURE = b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.5000000,10,2\n"
BURST1 = b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


@pytest.mark.parametrize(
    "data,needle",
    [
        (AZURE + b"2023-11-16 18:00:01.0,abc,3\n", "x:3: ContextTokens: expected an integer"),
        (AZURE + b"2023-11-16 18:00:01.0,5\n", "x:3: expected 3 columns, got 2"),
        (AZURE + b"yesterday,5,3\n", "x:3: TIMESTAMP"),
        (AZURE + b"2023-11-16 18:00:01.0,-5,3\n", "x:3: ContextTokens: -5 outside"),
        (BURST1 + b"5,ChatGPT,472,18,490,Conversation log\n6,ChatGPT,1,x,2,API log\n", "x:3: Response tokens"),
        (BURST1 + b"nan,ChatGPT,1,1,2,API log\n", "x:2: Timestamp: must be finite"),
        (
            b'{"timestamp": 0, "input_length": 1, "output_length": 2}\n{"timestamp": 5, "input_length": 1}\n',
            "x:2: output_length: missing",
        ),
        (b'{"timestamp": 0, "input_length": 1, "output_length": 2}\n{not json\n', "x:2: invalid JSON"),
        (b'{"timestamp": "0", "input_length": 1, "output_length": 2}\n', "x:1: timestamp: expected a number"),
        (b"a,b,c\n1,2,3\n", "x:1: unrecognised trace header"),
        (b"", "x: empty file"),
        (BURST1 + b"5,ChatGPT,0,0,0,API log\n", "x: no requests"),
    ],
)
def test_malformed_input_is_one_line_naming_file_and_line(data, needle):
    with pytest.raises(TraceError) as e:
        parse_trace(data, name="x")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_file():
    with pytest.raises(TraceError, match="cannot read"):
        load_trace("/nonexistent/trace.csv")


def test_unsorted_rows_are_sorted_and_crlf_bom_accepted():
    data = (
        "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:00:02.0,7,1\r\n2023-11-16 18:00:01.0,5,3\r\n"
    ).encode()
    tr = parse_trace(data)
    assert tr.arrival_s.tolist() == [0.0, 1.0] and tr.prompt_tokens.tolist() == [5, 7]


def test_burstgpt_columns_by_name():
    # v3 column set: Session ID and Elapsed time shift the token columns
    data = (
        b"Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        b"100.0,s1,4,GPT-4,30,40,70,Conversation log\n101.5,,2,ChatGPT,0,0,0,API log\n"
    )
    tr = parse_trace(data)
    assert tr.fmt == "burstgpt" and len(tr) == 1 and tr.prompt_tokens[0] == 30 and tr.output_tokens[0] == 40
