"""Routing replay for mixture-of-experts models: the experts the sampler chose for each completion token, recorded by
grpo_plus's generator, used again in every training-side forward of those tokens (`replay`), and the route-flip
receipt (`routing/route_flips`, `routing/router_flips`)."""
