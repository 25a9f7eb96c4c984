"""The ``openai`` client against ``vllm-specplug serve`` (or ``vllm serve``).

    vllm-specplug models fetch qwen-coder-pair
    vllm-specplug serve --config configs/qwen-coder-adaptive.yaml &
    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--model qwen-coder]

Non-streaming and streaming completions and chat; a per-request ceiling via
``vllm_xargs`` (``specplug_max_k``: 0 turns speculation off for that
request) and a fixed k (``specplug_k``: exactly that many drafts a step); per-request acceptance from the response's
``metrics.speculative_decoding`` (the server runs with
``per-request-spec-decode-metrics``).
"""

import argparse
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="qwen-coder")
    args = p.parse_args()

    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key="none")
    try:
        client.models.list()
    except openai.APIConnectionError:
        sys.exit(f"no server at {args.base_url}; start one with\n"
                 "  vllm-specplug models fetch qwen-coder-pair\n"
                 "  vllm-specplug serve "
                 "--config configs/qwen-coder-adaptive.yaml")

    prompt = "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    r = client.completions.create(model=args.model, prompt=prompt, max_tokens=64, temperature=0)
    print("completion:", r.choices[0].text)
    spec = (r.model_extra.get("metrics") or {}).get("speculative_decoding")
    if spec:
        print(f"  drafted {spec['num_draft_tokens']}, accepted "
              f"{spec['num_accepted_draft_tokens']}, mean acceptance length "
              f"{spec['mean_acceptance_length']:.2f}")

    print("streamed: ", end="", flush=True)
    for chunk in client.completions.create(model=args.model, prompt=prompt, max_tokens=64,
                                           temperature=0, stream=True):
        print(chunk.choices[0].text, end="", flush=True)
    print()

    # A per-request ceiling: no speculation for this one request.
    r = client.completions.create(model=args.model, prompt=prompt, max_tokens=32, temperature=0,
                                  extra_body={"vllm_xargs": {"specplug_max_k": 0}})
    spec = (r.model_extra.get("metrics") or {}).get("speculative_decoding")
    print("ceiling 0:", r.choices[0].text.strip()[:60], "| drafted:",
          spec["num_draft_tokens"] if spec else 0)

    # A fixed k: exactly two drafts every step for this request, not the adaptive choice.
    r = client.completions.create(model=args.model, prompt=prompt, max_tokens=32, temperature=0,
                                  extra_body={"vllm_xargs": {"specplug_k": 2}})
    spec = (r.model_extra.get("metrics") or {}).get("speculative_decoding")
    print("fixed k=2:", r.choices[0].text.strip()[:60], "| drafted per step:",
          spec["per_step_drafted"][:8] if spec else None)

    chat = client.chat.completions.create(
        model=args.model, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Write a Python function that reverses a string."}])
    print("chat:", chat.choices[0].message.content)
    for chunk in client.chat.completions.create(
            model=args.model, max_tokens=32, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Name three sorting algorithms."}]):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

    # A bad value is refused for that request only (HTTP 400).
    try:
        client.completions.create(model=args.model, prompt=prompt, max_tokens=4,
                                  extra_body={"vllm_xargs": {"specplug_max_k": -1}})
    except openai.BadRequestError as exc:
        print("rejected as expected:", exc.message[:120])


if __name__ == "__main__":
    main()
