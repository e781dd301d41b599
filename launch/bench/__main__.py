from launch.bench import run

if __name__ == "__main__":
    run()
