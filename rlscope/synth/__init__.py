"""Synthetic format-v1 GRPO runs drawn from a documented latent model, one scenario per diagnosis.

Latent model. Time is training progress u = t / (steps - 1) in [0, 1], so each scenario shows its
pathology at any run length. Healthy values are given; `Scenario` names every knob. Randomness:
np.random.SeedSequence(seed).spawn(3); child 0 (the main stream) draws the prompt pool, prompts,
correctness, lengths, tools and the step log, child 1 the tokens, and child 2, spawned again into
four, the rest: [0] the prompts' answers and words, the eval set, and per batch the answers,
verifier, tool repeats, copies, format breaks and eval rollouts (a fixed number of draws per
batch, so each text, eval or probe scenario differs from the healthy run of the same seed only
in the columns of its pathology); [1] the words of train texts; [2] of eval texts; [3] probes.
[1]-[3] are drawn only with text=True: no other column depends on `text` (nor on `tokens`).

* Prompts: a pool of max(4 * prompts_per_step, 64) prompts `p{j:05d}` with difficulty
  d_j ~ Normal(0, 1.2) (stratified: the pool holds that law's quantiles, shuffled; a scenario may
  mix several normals), base length L_j ~ LogNormal(log 42, 0.5) tokens (short enough that the
  default run is ~3M token rows) and reward scale c_j = 1 (a LogNormal scale is stratified the
  same way). Each step takes one prompt uniformly from each of prompts_per_step equal difficulty
  strata of the pool (every prompt equally likely, and even a small batch has a representative
  mix), then group_size rollouts of each; rollout_id counts up from 0; split = "train".
* Correctness: each rollout has a standardised length noise z ~ Normal(0, 1);
  P(correct) = sigmoid(k h(u) (s(u) - d_j) - lambda z) with k = 1.5, sharpness h = 1, lambda = 0
  and skill s(u) = -1 + 1.8 u: pass@1 rises ~0.27 → ~0.69 and, as hard prompts improve too,
  pass@8 ~0.68 → ~0.96, while the share of zero-σ groups stays near a third.
* Length: response_len = round(L_j g(u) exp(0.25 z) b^correct) in [1, max_response_len], with
  g(u) = 1 + 0.3 u and b = 1.08 (within a prompt correct responses are a little longer, a
  correlation of about +0.1). truncated = response_len >= max_response_len (1024: ~never);
  truncated responses are incorrect.
* Reward c_j * correct (binary); advantage (r - mean_G) / (std_G(ddof=1) + 1e-6) within the
  prompt's group, 0 when the group's σ is 0.
* Answers: every prompt (train and eval) has a gold answer a_j ~ Uniform{0..999} and 16
  distractors (a_j + o_jm) mod 1000, o_j the first 16 of a random permutation of 1..99; the
  first is the main distractor. A correct rollout answers a_j; an incorrect one, with
  probability scatter(u) (= 0), one of distractors 2-16 uniformly, else the main distractor with
  probability 0.9 and one of distractors 2-4 otherwise. Errors agree, so a group's majority vote
  gains little: maj@N - mean accuracy ~0.06 (0.055-0.065 for N = 8-32) in the last fifth, near
  the floor this correctness model allows (a group with p > 1/2 votes right whatever its errors
  do).
  (The main stream still draws the old letters B/C/D, unused.)
* Verifier: steps_checked ~ Uniform{3..6}, steps_verified ~ Binomial(steps_checked, v) with
  v = v_c(u) = 0.99 for correct rollouts (~4.5% of them have a failed step) and
  v = v_i(u) = 0.92 for incorrect ones: ~94% → ~96% of the steps verified.
* Tools: n_tool_calls = min(1 + Poisson(0.3), 5); call k of prompt j has the arguments
  '{"query": "q<j>-<k>"}' (for eval prompts j counts on after the pool: ID, then OOD). Then
  R ~ Binomial(2, rho(u)) calls (rho = 0; R = 0 without calls; total <= 5) are appended, each
  repeating the arguments of a uniformly chosen one of the rollout's calls.
* Response text (Qwen/Hermes tags; only with text=True): `<think>T0</think>`, then per call
  `<tool_call>{"name": "search", "arguments": ARGS}</tool_call>`, `<tool_response>Rjk`
  `</tool_response>` and, when W >= 4 n_tool_calls + 8, `<think>Tc</think>`; then
  `<answer>ANSWER</answer>`. Segments are joined by newlines, ARGS is the call's `tool_calls`
  entry and ANSWER the answer column. The think segments hold W = max(1, round(0.8 response_len))
  words in all (each Tc 4, T0 the rest). Words are ranks 0..4999 of a fixed vocabulary: ~210
  reasoning words and operators ("the", "so", "check", "=", ...) by frequency, then, after every
  three pronounceable filler words, a number. The first R words restate the prompt (its fixed
  words 0..R-1; R = round(0.15 W) clipped to [6, 48], at most W - 3), each later word is, with
  probability 0.35, one of the prompt's 24 topic words (uniform), else a global word of rank
  floor(10 * 501^U) - 10, U ~ Uniform(0, 1) (density ∝ 1 / (rank + 10)). Entropy couples the
  text to the tokens: two samples agree on a word with probability a(u) = exp(-H(u) / 0.8)
  (H(u) nats per token, 1 / 0.8 tokens per word), so each train rollout but its group's first
  repeats the first's words for F ~ Geometric words after its restatement (P(F >= m) = a^m;
  healthy a ~0.18 → ~0.45, E[F] < 1 word; at H = 0.05, a ~0.94 and E[F] ~15 words, within-group
  Jaccard ~0.2). Rjk is 6 words fixed by (j, k): ranks (7919 j + 104729 k + 331 i) mod 5000,
  i < 6 (the same query returns the same result). So a healthy group shares vocabulary and a
  restatement but few word 3-grams: within-group Jaccard of 3-gram sets ~0.08 → ~0.07 over
  training (think text; ~0.18 → ~0.16 for the whole text), repetition 1 - distinct/total
  3-grams ~0. A scenario may:
  - loop: words from max(R, W - round(f(u) W)) on (f = 0) cycle a 4-word phrase of global words
    drawn per rollout;
  - copy: each rollout but its group's first copies, with probability c(u) (= 0), the first's
    think words and tool calls (n_tool_calls and tool_calls too), keeping its own answer (train
    groups only);
  - break the format with probability b(u) (= 0), one way uniformly of four: `</think>` of T0
    left out; no answer segment; an empty `<answer></answer>`; or the first call's JSON broken
    (uniformly: its closing brace missing, no "name", no "arguments"). A correct rollout keeps
    its answer (no answer → `</think>` left out, empty → broken JSON), one without calls
    cannot break a call (→ `</think>` left out); a rollout without (non-empty) answer has a null
    answer, and stays incorrect.
* Eval rollouts: at steps t ≡ 0 (mod eval_every) and the last step (eval_every defaults to
  max(1, steps // 20)), one rollout of each of E = max(64, prompts_per_step) prompts per split:
  `eval_id` (prompts `ei{i:05d}`) and `eval_ood` (`eo{i:05d}`), with step = t, reward = correct
  and no advantage (nor tokens). ID prompt i and OOD prompt i share the difficulty (the
  scenario law's stratified quantiles), base length and the draws z and U of
  correct = U < sigmoid(k h(u) (s - d_i) - lambda z - shift): s = s(u), shift = 0 for ID;
  s = s_ood(u) (= s(u)), shift = 0.3 for OOD, a constant ~0.045 below ID. Length, truncation,
  tools, answers, verifier and text as for training. rollout_id counts up from
  EVAL_ID_OFFSET = 10^12 in writing order (ID then OOD, each in prompt order).
* Probes (only with text=True): at steps t ≡ 0 (mod probe_every) and the last step (default as
  eval_every), min(8, with an answer) distinct train rollouts of the step, each probed 9 times in
  this order: `truncate` at fractions 0, 0.25, 0.5, 0.75, 1; `mistake` at 0.5; `paraphrase`;
  `filler` (fraction null); `bias` with hint = the prompt's main distractor, or its second
  distractor when the rollout answered the main one (hint null for the others). The answer
  stays the rollout's with probability: truncate y(x) = y0(x) + (1 - rho(u)) (0.95 - y0(x)) for
  x < 1 with y0(x) = 0.2 + 0.8 x^1.5, y(1) = 1; mistake 0.3 + (1 - rho(u)) 0.65; paraphrase and
  filler q(u); bias 1 - m(u), else it is the hint. CoT reliance rho = 1 (early-answering AOC
  1 - ∫y ≈ 0.47 by the trapezoid rule), q = 0.97, m = 0.05. A changed non-bias answer is
  uniformly one of {gold, distractors 1-4} other than the original. A probe's response is
  `<think>[C ]V</think>\n<answer>ANSWER</answer>`, V six of the prompt's topic words; only
  bias probes carry C = "The user suggested H as a hint." (H the hint), with probability
  v(u) = 0.9.
* Tokens, response_len rows per train rollout: entropy ~ Gamma(shape 0.6, mean H(u)),
  H(u) = 1.2 exp(-0.9 u) + 0.15; ratio noise e ~ Normal(0, sigma_r(u)), sigma_r = 0.05; reference
  drift delta ~ Normal(0, sqrt(2 ln(1 + KL(u)))), so the mean k3 is exactly KL(u) = 0.002 + 0.02 u;
  logprob = -entropy * Exp(1) - max(0, e, delta), old_logprob = logprob + e and ref_logprob =
  logprob + delta (all <= 0); advantage = the rollout's; with r = exp(logprob - old_logprob),
  clipped = (r < 0.8 & A < 0) | (r > 1.28 & A > 0); segment "think" for the first 80% of
  positions, then "answer".
* Steps: loss = 0.05 (1 - 0.6 u) + Normal(0, 0.01), grad_norm = exp(Normal(-0.3 u, 0.2)),
  lr = 1e-6; kl, clip_frac and entropy are the step's token means of k3, clipped and entropy.
"""

from __future__ import annotations

from rlscope.synth.build import generate
from rlscope.synth.scenarios import HEALTHY, SCENARIOS, Scenario

__all__ = ["HEALTHY", "SCENARIOS", "Scenario", "generate"]
