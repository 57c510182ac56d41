"""Sampler and detokenizer: seeded reproducibility, masks, penalties, UTF-8 deltas, stop strings across tokens."""
import pytest
import torch
from transformers import AutoTokenizer

from engine import InvalidRequestError, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.models.loader import resolve_model_dir
from engine.request import Request
from engine import sampler
from engine.sampler import Sampler, top_k_top_p_min_p


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def r(params, rid="x"):
    return Request(rid, [1, 2, 3], params)


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    toks, _ = Sampler()(logits, [r(SamplingParams(temperature=0)) for _ in range(3)])
    assert toks == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    def draw(batch_extra):
        req = r(SamplingParams(temperature=1.0, seed=42))
        others = [r(SamplingParams(temperature=1.0)) for _ in range(batch_extra)]
        rows = torch.cat([logits, torch.randn(batch_extra, 1000)])
        return [Sampler()(rows, [req] + others)[0][0] for _ in range(1)] + \
               [Sampler()(rows, [req] + others)[0][0] for _ in range(5)]
    assert draw(0) == draw(3)
    # a request without a seed draws from the sampler's own generator, which moves on: seeded here, so that the draws
    # are the same on every run
    sampler = Sampler()
    sampler.generator.manual_seed(0)
    unseeded = {tuple(sampler(logits, [r(SamplingParams(temperature=1.0))])[0]) for _ in range(20)}
    assert len(unseeded) > 1


def test_sampled_frequencies_follow_the_tempered_softmax():
    """Temperature sampling draws each token with softmax(logits / T) probability (CDF inversion, engine.sampler),
    a masked token never: 40 000 seeded draws from two rows sharing a batch, each within 4 sigma of its probability."""
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5, -1.0], [3.0, 0.0, 0.0, 0.0, 0.0, 2.5]])
    temps = [0.7, 1.5]
    reqs = [r(SamplingParams(temperature=t, seed=i)) for i, t in enumerate(temps)]
    sampler, n = Sampler(), 20_000
    counts = torch.zeros(2, 6)
    for _ in range(n):
        toks, _ = sampler(logits, reqs)
        counts[0, toks[0]] += 1
        counts[1, toks[1]] += 1
    expected = (logits / torch.tensor(temps).unsqueeze(1)).softmax(-1)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert counts[0, 3] == 0
    assert ((counts / n - expected).abs() <= 4 * sigma + 1e-9).all(), (counts / n, expected)


def test_top_k_mask():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = top_k_top_p_min_p(logits, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = top_k_top_p_min_p(probs.log(), torch.tensor([-1]), torch.tensor([0.8]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    out = top_k_top_p_min_p(probs.log(), torch.tensor([-1]), torch.tensor([0.81]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def test_min_p_mask():
    probs = torch.tensor([[0.6, 0.3, 0.07, 0.03]])   # min_p 0.1 of 0.6: 0.06, away from any rounding
    out = top_k_top_p_min_p(probs.log(), torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.1]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def _mixed_rows(g: torch.Generator):
    """A batch of 8 rows over SmolLM2's vocabulary, some settled on their candidates (a peaked row, a narrow top-k) and
    some not (a flat row with top-p near 1, a top-k wider than the candidates, min-p alone): (logits, top_k, top_p,
    min_p)."""
    scale = torch.tensor([8.0, 8.0, 0.5, 0.5, 3.0, 8.0, 1.0, 4.0]).unsqueeze(1)
    logits = torch.randn(8, 49152, generator=g) * scale
    return (logits, torch.tensor([0, 50, 0, 0, 1000, 0, 128, 0]),
            torch.tensor([0.9, 0.95, 0.9, 1.0, 0.8, 0.999, 0.5, 1.0]),
            torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.01, 0.0, 0.2]))


def test_masks_from_the_largest_logits_equal_a_full_sort():
    """Rows settled on their TOP_CANDIDATES largest logits (a peaked row, a narrow top-k) and rows that need the whole
    sort (a flat row with top-p near 1, a top-k wider than the candidates, min-p alone) in one batch: each row's mask
    is the full sort's, and a row's mask does not depend on the rows beside it."""
    logits, top_k, top_p, min_p = _mixed_rows(torch.Generator().manual_seed(0))
    k = torch.where(top_k > 0, top_k, logits.shape[1])
    out = top_k_top_p_min_p(logits, top_k, top_p, min_p)
    want = sampler._masks_by_sort(logits, k, top_p, min_p)
    assert torch.equal(torch.isfinite(out), torch.isfinite(want))
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    settled = [int(torch.isfinite(want[i]).sum()) <= sampler.TOP_CANDIDATES for i in range(8)]
    assert any(settled) and not all(settled)   # both paths ran
    for i in range(8):
        alone = top_k_top_p_min_p(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], min_p[i:i + 1])
        assert torch.equal(torch.isfinite(alone[0]), torch.isfinite(out[i]))


def test_sampling_on_candidates_draws_what_the_masked_row_draws():
    """A row settled on its candidates draws among them alone (`sample_top_k_top_p_min_p`); it must pick, for every
    uniform number, the token that inverting the whole masked row's CDF picks (and rows that are not settled go that
    way), so the shortcut changes no seeded request's output."""
    g = torch.Generator().manual_seed(1)
    logits, top_k, top_p, min_p = _mixed_rows(g)
    masked = top_k_top_p_min_p(logits, top_k, top_p, min_p)
    drawn = set()
    for _ in range(200):
        u = torch.rand(8, generator=g)
        got = sampler.sample_top_k_top_p_min_p(logits, top_k, top_p, min_p, u)
        assert torch.equal(got, sampler.invert_cdf(masked, u))
        drawn.update(got.tolist())
    assert len(drawn) > 16   # rows with more than one kept token drew more than one
    for u in (torch.zeros(8), torch.full((8,), 1 - 2 ** -24)):   # the CDF's ends: the first and last kept token
        assert torch.equal(sampler.sample_top_k_top_p_min_p(logits, top_k, top_p, min_p, u),
                           sampler.invert_cdf(masked, u))


def test_sampled_tokens_respect_top_k():
    logits = torch.randn(1, 100)
    allowed = set(logits.topk(3).indices[0].tolist())
    for seed in range(30):
        tok, _ = Sampler()(logits, [r(SamplingParams(temperature=2.0, top_k=3, seed=seed))])
        assert tok[0] in allowed


def test_penalties():
    logits = torch.zeros(1, 10)
    logits[0, 5] = 2.0
    req = Request("p", [5], SamplingParams(temperature=0, repetition_penalty=4.0))
    tok, _ = Sampler()(logits.clone(), [req])
    assert tok == [5]                              # 2/4 = 0.5 still the max
    req = Request("p", [1], SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=0.5))
    req.token_ids += [5, 5]                        # two outputs of token 5: 2 - 2 - 1 = -1
    tok, _ = Sampler()(logits.clone(), [req])
    assert tok != [5]


def test_logprobs():
    logits = torch.randn(1, 20)
    tok, lps = Sampler()(logits, [r(SamplingParams(temperature=0, logprobs=3))])
    lp, top = lps[0]
    assert abs(lp - float(logits.log_softmax(-1)[0, tok[0]])) < 1e-6 and len(top) == 3 and top[0][0] == tok[0]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=0), dict(max_tokens=0),
                                 dict(min_p=2), dict(presence_penalty=3), dict(repetition_penalty=0)])
def test_invalid_values_raise_typed_error(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**bad)
    assert e.value.param == next(iter(bad))


def test_utf8_split_across_tokens(tokenizer):
    text = "naïve café 你好 🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [1])
    deltas = [d.add(t) for t in ids]
    assert "".join(deltas) + d.flush() == text
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_split_across_tokens_never_emitted(tokenizer):
    text = "Hello there. The END is near."
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [1], stop=["END is"])
    out = ""
    for t in ids:
        out += d.add(t)
        assert "E" not in out.replace("Hello", "")      # no part of the stop string leaks, even "E"/"EN"
        if d.stopped_by:
            break
    assert d.stopped_by == "END is"
    out += d.flush()
    assert out == "Hello there. The "


def test_held_back_text_is_released_when_not_a_stop(tokenizer):
    ids = tokenizer.encode("an ENDING word", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [1], stop=["END!"])
    out = "".join(d.add(t) for t in ids) + d.flush()
    assert out == "an ENDING word" and d.stopped_by is None


def test_min_tokens_masks_stop_tokens_until_reached():
    """min_tokens: EOS and stop_token_ids cannot be drawn before min_tokens output tokens, greedy or sampled; from then
    on they can. A row whose grammar allows only a stop token keeps it (the grammar's end wins)."""
    logits = torch.zeros(2, 8)
    logits[:, 5] = 10.0                      # the stop token is by far the most likely
    greedy = Request("g", [1, 2, 3], SamplingParams(temperature=0, min_tokens=2, max_tokens=8))
    sampled = Request("s", [1, 2, 3], SamplingParams(temperature=1.0, seed=0, min_tokens=2, max_tokens=8))
    for req in (greedy, sampled):
        req.stop_token_ids = frozenset({5, 99})   # 99: outside the vocabulary, ignored
    sampler = Sampler()
    for _ in range(2):
        toks, _ = sampler(logits, [greedy, sampled])
        assert 5 not in toks
        for req, t in zip((greedy, sampled), toks):
            req.token_ids.append(t)
    assert logits[0, 5] == 10.0                # the caller's logits are not touched
    toks, _ = sampler(logits, [greedy, sampled])
    assert toks[0] == 5                       # min_tokens reached: the stop token is the argmax again
    only_stop = torch.full((1, 8), float("-inf"))
    only_stop[0, 5] = 0.0                     # what a complete grammar leaves
    early = Request("e", [1, 2, 3], SamplingParams(temperature=0, min_tokens=4, max_tokens=8))
    early.stop_token_ids = frozenset({5})
    assert sampler(only_stop, [early])[0] == [5]


@pytest.mark.parametrize("bad", [dict(min_tokens=9, max_tokens=8), dict(min_tokens=-1), dict(min_tokens=1.5)])
def test_min_tokens_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**bad)
    assert e.value.param == "min_tokens"


def test_stop_strings_count_only_after_min_tokens(tokenizer):
    """vLLM's rule: the text of the first min_tokens tokens cannot end the output; a stop string that ends past it
    does, even one that starts inside it."""
    text = "Hello, my name is Lee, and I'm a student in the college of engineering"
    ids = tokenizer.encode(text, add_special_tokens=False)

    def run(min_tokens: int, stop: list[str]) -> tuple[str, int]:
        d = IncrementalDetokenizer(tokenizer, [1], stop=stop, min_tokens=min_tokens)
        out, n = "", 0
        for t in ids:
            out += d.add(t)
            n += 1
            if d.stopped_by:
                break
        return out + d.flush(), n

    assert run(0, ["e"])[0] == "H"
    head = tokenizer.decode(ids[:6])                   # the text of the first 6 tokens holds an "e"
    assert "e" in head
    out, n = run(6, ["e"])
    assert out.startswith(head) and n > 6 and out == text[:text.index("e", len(head))]
    # a stop string that starts in the protected text and ends past it counts
    cut = tokenizer.decode(ids[:5])
    straddle = cut[-2:] + tokenizer.decode(ids[:6])[len(cut):][:2]
    out, n = run(5, [straddle])
    assert n == 6 and out == text[:text.index(straddle, len(cut) - 2)]
