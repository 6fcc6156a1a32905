"""Image input: the rules of image parts, preprocessing, the decode limiter."""
