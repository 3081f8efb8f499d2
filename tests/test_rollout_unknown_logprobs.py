"""A log-prob a server leaves out stays unknown (issue #32, item 8).

An OpenAI-compatible server may answer ``null`` for a token's log-prob. It used to become 0.0
(probability 1), which fed M1's repetition rule (a run of confident tokens cuts the sample)
and the sums stored in ``rollouts``. Now it is None: the repetition rule skips it, a
completion with one reports no log-prob sum, and the RL stage's sampler log-probs mark it as
unknown. The server is a named FAKE (a healthy ``serve-model`` never answers ``null``).
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from tasks.rollout.base import Completion, SamplingParams
from tasks.rollout.config import OpenAIConfig
from tasks.rollout.openai_client import OpenAIBackend
from tasks.rollout.repetition import repetition_cut
from tasks.rollout.tiny_model import tiny_llama_path

CONFIDENT = -0.001   # probability 0.999, above M1's 0.99


class NullLogprobServer(BaseHTTPRequestHandler):
    """FAKE server: every choice is six tokens, the log-probs of some of them ``null``."""

    token_logprobs: ClassVar[list] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = ["a", "b", "c", "d", "e", "f"]
        choices = [{"index": i, "text": "".join(tokens), "finish_reason": "length", "token_ids": [5, 6, 7, 8, 9, 10],
                    "logprobs": {"tokens": tokens, "token_logprobs": type(self).token_logprobs}}
                   for i in range(body["n"] * len(body["prompt"]))]
        payload = json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def fake_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NullLogprobServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield OpenAIBackend(OpenAIConfig(base_url=f"http://127.0.0.1:{httpd.server_port}/v1", served_model="fake"))
    finally:
        httpd.shutdown()


def test_a_null_logprob_stays_unknown_and_never_cuts_a_sample(fake_server):
    NullLogprobServer.token_logprobs = [None, None, None, None, -2.0, None]
    params = SamplingParams(n=2, max_tokens=6, repetition_window=3, repetition_prob=0.99)
    out = fake_server.generate(["p"], params)
    for completion in out[0]:
        assert completion.logprobs == [None, None, None, None, -2.0, None]
        # four nulls in a row were a run of "probability 1" tokens, cut after the third
        assert not completion.truncated and completion.text == "abcdef" and len(completion.token_ids) == 6
        assert completion.logprob_summary() == (None, None)


def test_the_repetition_rule_counts_only_known_confident_tokens(fake_server):
    # known confident tokens around the nulls still make a run: the nulls neither end nor extend it
    NullLogprobServer.token_logprobs = [CONFIDENT, None, CONFIDENT, None, CONFIDENT, -2.0]
    out = fake_server.generate(["p"], SamplingParams(n=1, max_tokens=6, repetition_window=3))
    completion = out[0][0]
    assert completion.truncated and completion.text == "abcde" and completion.logprobs == [CONFIDENT, None,
                                                                                          CONFIDENT, None, CONFIDENT]
    assert repetition_cut([CONFIDENT, None, CONFIDENT, -2.0, CONFIDENT], 2, 0.99) == 3
    assert repetition_cut([None] * 10, 1, 0.99) is None


def test_known_logprobs_are_summed_as_before():
    assert Completion("x", [1, 2], logprobs=[-0.5, -1.5]).logprob_summary() == (-2.0, -1.0)
    assert Completion("x", [1], logprobs=None).logprob_summary() == (None, None)


def test_rl_marks_the_sampler_logprobs_it_does_not_know(tmp_path):
    from transformers import AutoTokenizer

    from tasks.train.encoding import encode_prompt, pad_id_of
    from tasks.train.rl import RolloutBatch, _training_tensors

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path(home=tmp_path))
    row = {"prompt_id": "p1", "prompt": "What is 2 + 2?", "domain": "math"}
    batch = RolloutBatch(group_size=2)
    batch.add_group(row, [Completion("a", [5, 6, 7], logprobs=[-0.5, None, -0.25]),
                          Completion("b", [5, 6], logprobs=None)], [1.0, 0.0])
    tensors = _training_tensors(batch, tokenizer, {}, pad_id_of(tokenizer))
    start = len(encode_prompt(tokenizer, row["prompt"], row["domain"])) - 1   # the first response token
    known, sampler = tensors["sampler_logp_known"], tensors["sampler_logp"]
    assert known[0, start:start + 3].tolist() == [1.0, 0.0, 1.0]
    assert sampler[0, start:start + 3].tolist() == [-0.5, 0.0, -0.25]
    assert known[1].sum() == 0                      # a completion without log-probs: none known
    assert known.sum() == 2 and (known <= tensors["mask"]).all()
