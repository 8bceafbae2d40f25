"""moe_decoder's Prometheus metrics: what `DecoderService.stats()` and `observe()` name, what the
adapter (`models/moe_decoder.py`) publishes each as, where each value is read (`service_stats`), and
what a finished request adds to them."""

# stats() name -> (Prometheus metric, help), as the adapter publishes them; counters only grow.
COUNTERS = {
    "requests_completed": ("zipmoe_requests_completed_total", "Requests that finished generating"),
    # The next three count finished requests only (not cancelled ones): decode_us / decode_tokens is their ITL.
    "ttft_us": ("zipmoe_ttft_microseconds_total", "Sum of time to first token (arrival to first token)"),
    "decode_us": ("zipmoe_decode_microseconds_total", "Sum of time from first to last token"),
    "decode_tokens": ("zipmoe_decode_tokens_total", "Tokens generated after the first one, by finished requests"),
    "prompt_tokens": ("zipmoe_prompt_tokens_total", "Prompt tokens prefilled"),
    "preemptions": ("zipmoe_preemptions_total", "Sequences preempted for lack of KV blocks"),
    "engine_steps": ("zipmoe_engine_steps_total", "Engine steps run: decode, prompt chunks or both"),
    "engine_steps_pipelined": ("zipmoe_engine_steps_pipelined_total",
                               "Steps launched before the previous step's tokens were read back (async_scheduling)"),
    # Steps with prompt tokens by how they ran (engine/runner.py), each from its inputs to its tokens on the host.
    "prompt_steps_pipelined": ("zipmoe_prompt_steps_pipelined_total",
                               "Steps with prompt tokens run as rows of a decode step's CUDA graph, launched "
                               "behind the step in flight (async_scheduling)"),
    "prompt_steps_decode_graph": ("zipmoe_prompt_steps_decode_graph_total",
                                  "Steps with prompt tokens run as rows of a decode step's CUDA graph"),
    "prompt_steps_piecewise": ("zipmoe_prompt_steps_piecewise_total",
                               "Steps with prompt tokens run as piecewise CUDA graphs around an eager attention"),
    "prompt_steps_eager": ("zipmoe_prompt_steps_eager_total", "Steps with prompt tokens run eagerly"),
    "prompt_step_us_pipelined": ("zipmoe_prompt_step_pipelined_microseconds_total", "Time of those steps, summed"),
    "prompt_step_us_decode_graph": ("zipmoe_prompt_step_decode_graph_microseconds_total", "Time of those steps, summed"),
    "prompt_step_us_piecewise": ("zipmoe_prompt_step_piecewise_microseconds_total", "Time of those steps, summed"),
    "prompt_step_us_eager": ("zipmoe_prompt_step_eager_microseconds_total", "Time of those steps, summed"),
    "gpu_turn_waits": ("zipmoe_gpu_turn_waits_total", "Steps held back while vision_encoder had the GPU (gpu_turn_ms)"),
    "gpu_turn_wait_us": ("zipmoe_gpu_turn_wait_microseconds_total", "Time those steps were held back, summed"),
    "requests_cancelled": ("zipmoe_requests_cancelled_total", "Requests stopped because the client cancelled"),
    "requests_rejected_busy": ("zipmoe_requests_rejected_busy_total",
                               "Requests refused busy: max_waiting_requests waiting, or max_queue_delay_ms passed"),
    # Python's collector in the decoder's process: each collection stalls the engine loop (gc_pauses.py).
    "gc_collections": ("zipmoe_gc_collections_total", "Garbage collections in moe_decoder's process"),
    "gc_full_collections": ("zipmoe_gc_full_collections_total", "Of those, full (generation 2) collections"),
    "gc_pause_us": ("zipmoe_gc_pause_microseconds_total", "Time those collections held the process, summed"),
    # Routing: sums over decode layer-steps (union_after / layer_steps = mean experts read per layer).
    "layer_steps": ("zipmoe_moe_layer_steps_total", "MoE layer executions in decode steps"),
    "union_before": ("zipmoe_moe_union_before_total", "Distinct experts the router chose, summed"),
    "union_after": ("zipmoe_moe_union_after_total", "Distinct experts computed after re-routing, summed"),
    "rerouted_slots": ("zipmoe_moe_rerouted_slots_total", "Token slots moved to another expert"),
    "decode_tokens_beside_prompts": ("zipmoe_decode_tokens_beside_prompts_total",
                                     "Decode tokens computed in steps with prompt tokens (routed top-K but under "
                                     "truncate; not in the sums above)"),
    # VisionZip, whichever path compressed (mm_qa's vision_encoder or mm_qa_bls): kept / before.
    "visual_tokens": ("zipmoe_visual_tokens_total", "Merged visual tokens of the requests' images, before VisionZip"),
    "visual_tokens_kept": ("zipmoe_visual_tokens_kept_total", "Visual tokens kept by VisionZip and prefilled"),
}
GAUGES = {
    "kv_blocks_free": ("zipmoe_kv_blocks_free", "KV cache blocks not held by any sequence"),
    "kv_blocks_total": ("zipmoe_kv_blocks_total", "KV cache blocks in all"),
    "kv_capacity_tokens": ("zipmoe_kv_capacity_tokens", "Tokens the KV cache holds (sized at load)"),
    "running": ("zipmoe_running_requests", "Sequences admitted: decoding, or their prompt being prefilled"),
    "waiting": ("zipmoe_waiting_requests", "Sequences waiting for admission"),
    "degradation_level": ("zipmoe_degradation_level", "Load-adaptive keep ratio: the level (0: no request degraded)"),
    "load_pressure": ("zipmoe_load_pressure", "Largest of waiting / max_num_seqs, KV used / high water, "
                                              "TTFT / ttft_target_ms (1: at the limit)"),
}
# observe() name -> (Prometheus histogram, help, bucket upper bounds); one observation per
# finished request (an observation is a round trip to the server, too dear per token). The inter-token
# latency is the request's mean, (last token - first token) / (tokens - 1), as genai-perf and AIPerf
# define it per request.
HISTOGRAMS = {
    "ttft_s": ("zipmoe_ttft_seconds", "Time to first token per request (arrival at moe_decoder to first token)",
               (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)),
    "itl_s": ("zipmoe_inter_token_latency_seconds", "Mean time between a request's tokens after the first",
              (0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)),
    # Requests with images only (whichever path chose it: vision_encoder or mm_qa_bls).
    "keep_ratio": ("zipmoe_visual_keep_ratio", "Keep ratio VisionZip used per request with images",
                   (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)),
}


def finished_request(p, now: float) -> tuple[dict[str, int], dict[str, float]]:
    """What a request that finished at `now` adds to the metrics (p: the decoder's Pending, its sequence
    done): (COUNTERS increments, HISTOGRAMS observations)."""
    seq = p.seq
    ttft_s, decode_s, gaps = seq.first_token_time - seq.arrival, now - seq.first_token_time, len(seq.output_ids) - 1
    counts = {"requests_completed": 1, "prompt_tokens": len(seq.prompt_ids), "ttft_us": int(ttft_s * 1e6),
              "decode_us": int(decode_s * 1e6), "decode_tokens": gaps, "visual_tokens": p.tokens_before,
              "visual_tokens_kept": int(p.tokens_kept.sum())}
    observed = {"ttft_s": ttft_s}
    if gaps:
        observed["itl_s"] = decode_s / gaps
    if p.tokens_kept.size:
        observed["keep_ratio"] = p.keep_ratio
    return counts, observed


def prompt_step_counts(steps: dict[str, list]) -> dict[str, int]:
    """runner.prompt_steps ({path: [steps, seconds]}, engine/runner.py's PROMPT_PATHS) as the stats'
    prompt_steps_<path> and prompt_step_us_<path>."""
    return {**{f"prompt_steps_{path}": n for path, (n, _) in steps.items()},
            **{f"prompt_step_us_{path}": int(s * 1e6) for path, (_, s) in steps.items()}}


def service_stats(counts: dict[str, int], engine, controller, gc_stats: dict[str, int], wait: bool) -> dict:
    """Every COUNTERS and GAUGES value: the service's own `counts`, the engine's (scheduler, KV cache,
    routing sums: `RoutingStats.snapshot(wait)`, prompt steps and the decode tokens beside them), the
    degradation `controller`'s (None: off) and the collector's pauses."""
    sched = engine.scheduler
    return {**counts, "preemptions": sched.num_preemptions,
            "engine_steps": engine.steps_run, "engine_steps_pipelined": engine.steps_pipelined,
            "kv_blocks_free": engine.blocks.num_free, "kv_blocks_total": engine.blocks.num_blocks,
            "kv_capacity_tokens": engine.kv_capacity_tokens,
            "running": len(sched.running), "waiting": len(sched.waiting),
            "degradation_level": controller.level if controller else 0,
            "load_pressure": round(controller.pressure, 3) if controller else 0.0,
            **engine.routing_stats.snapshot(wait), **gc_stats, **prompt_step_counts(engine.runner.prompt_steps),
            "decode_tokens_beside_prompts": engine.runner.decode_rows_beside_prompts}
