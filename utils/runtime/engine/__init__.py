"""The ranks' side of a job: the model loaded on a rank, the rank loop, a batch's stages, the prompts
file's job, many images after one load (many_images.py), outputs, the console; imports requests and http."""
