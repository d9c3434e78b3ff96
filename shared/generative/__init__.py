"""The generative maths: the objective seam (DDPM, flow, MeanFlow), the samplers' registry and samplers, ODE solvers, classifier-free guidance."""
