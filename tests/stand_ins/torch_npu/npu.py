def is_available() -> bool:
    return True
