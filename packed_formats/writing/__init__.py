"""The write path: from a source to an archive (convert, the per-sample recipe, parallel
workers, sets written in parts and joined).
"""
