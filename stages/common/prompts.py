"""Prompts as models send them, timed by the Hopper attention stages (4 and 9) beside the long sequences:
short, causal, in bf16, most with Llama-3's and Mixtral's 32 query heads over 8 KV heads. Here a tile's
start-up and the causal diagonal weigh more than the main loop, and B·H rather than the sequence fills
the SMs."""

SHORT_PROMPTS = tuple(dict(B=B, H=H, Hkv=Hkv, Sq=S, Skv=S, D=D, causal=True, dtype="bfloat16")
                      for B, H, Hkv, S, D in ((8, 32, 8, 512, 64), (8, 32, 8, 512, 128), (32, 16, 16, 256, 64),
                                              (4, 32, 8, 1024, 128)))
