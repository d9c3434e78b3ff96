"""The generative maths: the objective seam (DDPM, flow), the samplers' registry and samplers, ODE solvers, classifier-free guidance."""
